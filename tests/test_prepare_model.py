"""One model preparation below every trainer (seqpar.hf.prepare): `seqpar train` (train/model/build.py), the HF
Trainer drop-in and the TRL SFT drop-in prepare the same tiny Llama, from the same weights and the same spec
(SP over 2 gloo ranks, fused loss with 4-token chunks, 2 MLP tiles), into the same module structure (module
types, the instance-level forwards seqpar installs, the attention implementation, trainable parameters), and
one micro-batch through each gives the same loss and gradients, bitwise (identical ops on identical weights).
The frozen DPO reference of `seqpar train` and of the HF DPO drop-in: the same structure but for the tiles,
which only `seqpar train` gives its reference (PrepareSpec.tile_reference). One spawned world serves all.
"""

from __future__ import annotations

import torch

from seqpar.spawn import run_distributed

VOCAB_ROWS = [[5, 9, 11, 2, 7, 31, 8, 3, 14, 6, 22, 17], [4, 12, 19, 25, 3, 9, 40, 2]]


def _forward_name(module: torch.nn.Module) -> str:
    """The instance-level forward seqpar installed on `module` ("" for none; the Trainer's own, e.g. accelerate's
    wrapper of the root forward, belongs to the stack)."""
    f = module.__dict__.get("forward")
    fn = getattr(f, "__func__", f)
    name = getattr(fn, "__name__", type(fn).__name__)
    where = getattr(fn, "__module__", None) or type(fn).__module__
    return name if f is not None and where.startswith("seqpar.") else ""


def _structure(model: torch.nn.Module) -> dict:
    from seqpar.unwrap import base_model

    base = base_model(model)
    return {
        "modules": [(n, type(m).__name__, _forward_name(m)) for n, m in base.named_modules()],
        "trainable": [n for n, p in base.named_parameters() if p.requires_grad],
        "seqpar_attention": base.config._attn_implementation.startswith("seqpar_sp_"),
    }


def _grads(model: torch.nn.Module, batch: dict, mesh) -> tuple[float, dict[str, torch.Tensor]]:
    from seqpar import loss as L
    from seqpar.steps import StepSpec, count_items, micro_batch_loss

    model.train()
    spec = StepSpec("sft", fused_loss=True, loss_chunk_tokens=4)
    num = L.global_token_count(count_items([batch], "sft"), mesh)
    share, _ = micro_batch_loss(model, batch, num, mesh, spec)
    share.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(L.global_loss(share, mesh)), grads


def _three_ways(out: str) -> dict:
    import datasets
    import trl
    from transformers import TrainingArguments

    import seqpar
    from seqpar.data import SequenceParallelCollator
    from seqpar.hf import tiny_model
    from seqpar.hf.trainer import SequenceParallelDPOTrainer, SequenceParallelTrainer
    from seqpar.train.config import config_from_dict
    from seqpar.train.model.build import build_model
    from seqpar.trl import SequenceParallelSFTTrainer

    mesh = seqpar.init_mesh(2)
    ds = datasets.Dataset.from_list([{"input_ids": r} for r in VOCAB_ROWS])
    batch = SequenceParallelCollator(mesh, 0)([{"input_ids": r} for r in VOCAB_ROWS])
    model = lambda: tiny_model("llama", 4, 2, vocab_size=64, seed=0)  # noqa: E731
    common = dict(report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, bf16=False)
    sp = dict(mesh=mesh, fused_loss=True, loss_chunk_tokens=4, tiled_mlp=2)

    run = {"model": {"name": "tiny:llama"}, "dataset": {"path": f"{out}/none.jsonl", "max_length": 64},
           "memory": {"fused_loss": True, "loss_chunk_tokens": 4, "tiled_mlp": 2}, "output_dir": f"{out}/train",
           "progress": False}
    train_model, _, _ = build_model(config_from_dict(run), model(), mesh, torch.device("cpu"), 2)
    hf = SequenceParallelTrainer(model=model(), args=TrainingArguments(output_dir=f"{out}/hf", **common),
                                 train_dataset=ds, **sp).model
    from seqpar.hf import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()  # TRL wants a real tokenizer; the rows are token ids < 64 already
    trl_model = SequenceParallelSFTTrainer(model=model(), args=trl.SFTConfig(output_dir=f"{out}/trl", **common),
                                           train_dataset=ds, processing_class=tok, **sp).model
    res = {name: {"structure": _structure(m), "grads": _grads(m, batch, mesh)}
           for name, m in (("train", train_model), ("hf", hf), ("trl", trl_model))}

    dpo = config_from_dict({**run, "stage": "dpo", "output_dir": f"{out}/dpo"})
    _, train_ref, _ = build_model(dpo, model(), mesh, torch.device("cpu"), 2)
    hf_dpo = SequenceParallelDPOTrainer(model=model(), args=TrainingArguments(output_dir=f"{out}/hfdpo", **common),
                                        **sp)
    res["ref"] = {"train": _structure(train_ref.ref_model), "hf": _structure(hf_dpo._sp_reference.ref_model)}
    return res


def test_train_hf_and_trl_prepare_the_same_model(tmp_path):
    for r in run_distributed(_three_ways, 2, str(tmp_path), timeout=600):
        s = {k: r[k]["structure"] for k in ("train", "hf", "trl")}
        assert s["train"] == s["hf"] == s["trl"]
        forwards = {f for _, _, f in s["train"]["modules"] if f}
        assert forwards == {"TiledForward", "_fused_forward"}, forwards  # tiles and the fused head, nothing else
        assert s["train"]["seqpar_attention"]
        loss, grads = r["train"]["grads"]
        for other in ("hf", "trl"):
            o_loss, o_grads = r[other]["grads"]
            assert o_loss == loss and o_grads.keys() == grads.keys(), other
            assert all(torch.equal(o_grads[n], g) for n, g in grads.items()), other
        ref_train, ref_hf = r["ref"]["train"], r["ref"]["hf"]
        untile = lambda mods: [(n, t, "" if f == "TiledForward" else f) for n, t, f in mods]  # noqa: E731
        assert untile(ref_train["modules"]) == ref_hf["modules"] and ref_hf["trainable"] == []
        assert ref_train["trainable"] == [] and ref_train["seqpar_attention"] and ref_hf["seqpar_attention"]
