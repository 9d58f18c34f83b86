"""What the vLLM engine tests share: a few prompts, and the engine's log-probs checked against transformers."""

from __future__ import annotations

import torch

LP_TOL = 1e-4  # engine log-prob vs an independent transformers recompute, fp32
PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40]]


def recompute_gap(model: torch.nn.Module, ids: list[list[int]], lps: list[list[float]],
                  prompts: list[list[int]] = PROMPTS) -> float:
    """Max |engine log-prob - log_softmax(transformers logits)| over the sampled tokens (temperature 1)."""
    worst = 0.0
    with torch.no_grad():
        for p, c, lp in zip(prompts, ids, lps):
            logits = model(torch.tensor([p + c])).logits[0].float()
            ref = torch.log_softmax(logits, -1)[len(p) - 1:len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None])
            worst = max(worst, float((ref[:, 0] - torch.tensor(lp)).abs().max()))
    return worst
