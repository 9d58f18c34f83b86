"""Hybrid models (Qwen3-Next, Qwen3.5: Gated DeltaNet; Nemotron-H, Granite 4: Mamba2 + softmax attention) under SP.

The SP model (seqpar collator -> apply_sequence_parallel -> seqpar.loss, gradients summed over the
ranks) is compared with an independent single-process reference: the plain HF model run on every
row / every packed document on its own, unpadded, with a hand-written shift + CE. Compared: loss,
EVERY parameter gradient (Gated DeltaNet conv1d / A_log / dt_bias / norm, Mamba2 conv1d / A_log / D / dt_bias /
norm, MoE experts and router included), the logits of every real token. Tolerance: fp32, 1e-5 absolute on loss
and gradients, 2e-5 on logits (values ~1-5). "f64:" cases run both models in float64 with the recurrences
swapped for the token-by-token float64 loops of tests/recurrent_ref.py (transformers' torch paths compute in
fp32): 1e-6, because transformers keeps a few per-token steps in fp32 even in a float64 model (the Gated
DeltaNet decay g, Mamba2's A and its gated RMSNorm), whose 1-ulp flips on inputs that differ in the 16th digit
show at ~1e-7; the float64 agreement of the state passing itself is tests/test_recurrent.py's (1e-10).
Sequences are longer than the recurrences' chunks (64 / 16 tokens), and packed documents have boundaries
inside shards (documents of 70 / 37 / 23 / 30 tokens on 80-, 40-, 20- or 26-token shards).

Modes: Ulysses 2 / 4, ring 2 (zigzag, contiguous, chain and scan state passing), ring 3 (odd), ring 4,
USP 2 x 2, dp 2 x ring 2. Refusals (k heads / Mamba2 heads the Ulysses degree cannot split, the MoE aux
loss) are checked in process, and once in a spawned world (every rank raises alike, before any collective).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from recurrent_ref import patched_float64_kernels

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelCollator
from seqpar.errors import SeqParError
from seqpar.hf import apply_sequence_parallel, remove_sequence_parallel, tiny_model
from seqpar.hf.equivalence import sp_sft_step
from seqpar.mesh import SequenceParallelMesh
from seqpar.spawn import run_distributed

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
LOGIT_TOL = 2e-5
F64_TOL = 1e-6
VOCAB = 160
DOCS = (70, 37, 23, 30)  # packed: 160 tokens, boundaries 70 / 107 / 130


def _rows(kind: str, seed: int, n_dp: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    lengths = {"pad": (90, 71), "packed": DOCS}[kind]
    out = []
    for d in range(n_dp):
        rows = []
        for n in lengths:
            n = n - d  # dp ranks get different rows
            ids = torch.randint(3, VOCAB, (n,), generator=g)
            labels = ids.clone()
            labels[: int(torch.randint(1, 8, (1,), generator=g))] = -100
            rows.append({"input_ids": ids, "labels": labels})
        out.append(rows)
    return out


def _reference(model, rows_per_dp):
    """Mean NLL over every supervised target of the global batch; per-dp list of per-document logits."""
    total, count, logits = 0.0, 0, []
    for rows in rows_per_dp:
        lg = []
        for r in rows:
            ids, labels = r["input_ids"], r["labels"]
            lo = model(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None]).logits[0]
            keep = labels[1:] != -100
            lp = torch.log_softmax(lo[:-1].double(), -1)[keep]
            total = total - lp.gather(1, labels[1:][keep][:, None]).sum()
            count += int(keep.sum())
            lg.append(lo.detach())
        logits.append(lg)
    return total / count, logits


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def _lora(model, seed: int):
    """LoRA on every Linear (Gated DeltaNet projections included; Mamba2 models: every Linear but the mixers'
    out_proj, which peft refuses for them, so in_proj and the attention / MLP projections), B initialised randomly
    so A gets gradients."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    targets = "all-linear"
    if any("Mamba" in type(m).__name__ for m in model.modules()):
        targets = [n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and not n.endswith(("out_proj", "lm_head"))]
        targets = sorted(set(targets))
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def run_case(mesh, arch: str, kind: str, seed: int = 0) -> dict:
    """Errors of one case on this rank: loss, max gradient, logits; SP vs the single-process reference.

    arch "lora:<arch>": LoRA adapters (peft) on both models, SP applied to the PeftModel; "f64:<arch>": both
    models in float64 with float64 recurrences (recurrent_ref.patched_float64_kernels)."""
    if arch.startswith("f64:"):
        arch = arch.removeprefix("f64:")
        module = type(tiny_model(arch, num_layers=1)).__module__.replace("transformers.models.", "")
        with patched_float64_kernels(f"transformers.models.{module}"):
            out = _run(mesh, arch, kind, seed, torch.float64)
        return {**out, "tol": F64_TOL}
    return _run(mesh, arch, kind, seed, torch.float32)


def _run(mesh, arch: str, kind: str, seed: int, dtype: torch.dtype) -> dict:
    lora = arch.startswith("lora:")
    arch = arch.removeprefix("lora:")
    ref = tiny_model(arch, seed=seed, dtype=dtype).train()
    sp = tiny_model(arch, seed=seed, dtype=dtype)
    if lora:
        ref, sp = _lora(ref, seed + 7), _lora(sp, seed + 7)
    sp = apply_sequence_parallel(sp, mesh).train()
    n_linear = sum(1 for m in sp.modules() if "forward" in m.__dict__)
    assert n_linear >= 1, "no recurrent layer got the SP forward"
    rows = _rows(kind, 100 + seed, mesh.dp_size)
    want, ref_logits = _reference(ref, rows)
    want.backward()
    batch = SequenceParallelCollator(mesh, pad_token_id=0, packing=(kind == "packed"))(rows[mesh.dp_rank])
    share, full, _ = sp_sft_step(sp, batch, mesh)
    got = L.global_loss(share, mesh)
    lerr, off = 0.0, 0
    for i, lo in enumerate(ref_logits[mesh.dp_rank]):
        if kind == "packed":
            lerr = max(lerr, float((full[0, off : off + lo.shape[0]] - lo).abs().max()))
            off += lo.shape[0]
        else:
            lerr = max(lerr, float((full[i, : lo.shape[0]] - lo).abs().max()))
    gs, gr = _grads(sp), _grads(ref)
    assert gs.keys() == gr.keys()
    missing = [n for n, p in sp.named_parameters() if p.requires_grad and p.grad is None and "experts" not in n]
    if lora:
        assert any("lora_A" in n and ("linear_attn" in n or "mamba" in n or "mixer" in n)
                   and float(g.abs().max()) > 0 for n, g in gs.items())
    return {
        "loss": abs(float(got) - float(want.detach())),
        "grad": max(float((gs[k].double() - gr[k].double()).abs().max()) for k in gs),
        "logits": lerr,
        "no_grad": missing,  # parameters the SP forward never used (experts may legitimately get no token)
        "value": float(want.detach()),
    }


# name: (sp size, ulysses, ring, layout, state passing)
MODES = {"ulysses2": (2, 2, 1, "zigzag", "chain"), "ulysses4": (4, 4, 1, "zigzag", "chain"),
         "dp2xulysses2": (2, 2, 1, "zigzag", "chain"), "sp1": (1, 1, 1, "zigzag", "chain"),
         "ring2": (2, 1, 2, "zigzag", "chain"), "ring2scan": (2, 1, 2, "zigzag", "scan"),
         "ring2c": (2, 1, 2, "contiguous", "chain"), "ring3": (3, 1, 3, "zigzag", "chain"),
         "ring3scan": (3, 1, 3, "zigzag", "scan"), "ring4": (4, 1, 4, "zigzag", "chain"),
         "ring4scan": (4, 1, 4, "zigzag", "scan"), "usp2x2": (4, 2, 2, "zigzag", "chain"),
         "usp2x2scan": (4, 2, 2, "zigzag", "scan"), "dp2xring2": (2, 1, 2, "zigzag", "chain")}


def world_cases(cases, refusals: bool = False):
    meshes, out = {}, []
    for mode, arch, kind in cases:
        sp, u, r, layout, passing = MODES[mode]
        if (sp, u, r, layout) not in meshes:
            meshes[(sp, u, r, layout)] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r, layout=layout)
        mesh = dataclasses.replace(meshes[(sp, u, r, layout)], state_passing=passing)  # same process groups
        out.append(((mode, arch, kind), run_case(mesh, arch, kind)))
    if refusals:  # every rank must raise the same error at apply time, before communicating
        world = torch.distributed.get_world_size()
        msgs = []
        for arch, kw in (("qwen3_next", {"linear_num_key_heads": 3, "linear_num_value_heads": 6}),
                         ("nemotron_h", {"mamba_num_heads": 3, "n_groups": 3})):
            try:
                apply_sequence_parallel(tiny_model(arch, **kw), seqpar.init_mesh(world, ulysses_degree=world,
                                                                                  ring_degree=1))
                msgs.append("not refused")
            except SeqParError as e:
                msgs.append(str(e))
        out.append((("refusals",), {"messages": msgs}))
    return out


def _assert_results(per_rank):
    bad, every = [], []
    for rank, results in enumerate(per_rank):
        for key, r in results:
            if key == ("refusals",):
                assert "does not divide" in r["messages"][0] and "[1, 3]" in r["messages"][0], r["messages"]
                assert "cannot split" in r["messages"][1] and "[1, 3]" in r["messages"][1], r["messages"]
                assert r["messages"] == per_rank[0][-1][1]["messages"]  # identical on every rank
                continue
            every.append(r)
            tol = r.get("tol")
            ok = (r["loss"] <= (tol or LOSS_TOL) and r["grad"] <= (tol or GRAD_TOL)
                  and r["logits"] <= (tol or LOGIT_TOL))
            if not ok or r["no_grad"]:
                bad.append((rank, key, r))
    assert not bad, "SP != no-SP:\n" + "\n".join(map(str, bad))
    worst = {k: max(r[k] for r in every) for k in ("loss", "grad", "logits")}
    print(f"{len(every)} case-ranks, worst errors: {worst}")  # shown with pytest -s


CASES_W2 = [
    ("ulysses2", "qwen3_next", "pad"),
    ("ring2", "qwen3_next", "packed"),
    ("ring2scan", "qwen3_5", "pad"),
    ("ulysses2", "nemotron_h", "packed"),
    ("ring2", "nemotron_h", "packed"),
    ("ring2", "f64:qwen3_5", "packed"),
    ("ring2scan", "f64:nemotron_h", "packed"),
    ("ring2", "bamba", "packed"),  # Bamba: Granite 4's Mamba2 mixer with a dense MLP
]
CASES_W2_SLOW = [
    ("ulysses2", "qwen3_next", "packed"),
    ("ulysses2", "qwen3_5", "packed"),
    ("ulysses2", "qwen3_5", "pad"),
    ("ulysses2", "qwen3_5_moe", "packed"),
    ("ring2c", "qwen3_next", "pad"),
    ("ring2c", "granitemoehybrid", "packed"),
    ("ring2", "granitemoehybrid", "pad"),
    ("ulysses2", "bamba", "pad"),
    ("ring2scan", "nemotron_h", "pad"),
    ("ulysses2", "f64:qwen3_next", "packed"),
    ("ring2", "lora:qwen3_next", "packed"),
    ("ring2", "lora:nemotron_h", "pad"),
    ("ulysses2", "lora:qwen3_5", "pad"),
]
CASES_W4 = [
    ("ulysses4", "qwen3_next", "pad"),
    ("ulysses4", "qwen3_5", "packed"),
    ("ulysses4", "qwen3_5_moe", "pad"),
    ("ulysses4", "nemotron_h", "packed"),  # 2 Mamba2 groups at Ulysses 4: each group's B / C on two ranks
    ("dp2xulysses2", "qwen3_next", "packed"),
    ("ring4", "qwen3_next", "packed"),
    ("ring4scan", "qwen3_5", "pad"),
    ("ring4", "nemotron_h", "packed"),
    ("ring4", "granitemoehybrid", "packed"),
    ("usp2x2", "qwen3_next", "packed"),
    ("usp2x2scan", "qwen3_5", "packed"),
    ("usp2x2", "nemotron_h", "pad"),
    ("usp2x2", "granitemoehybrid", "packed"),
    ("usp2x2", "bamba", "pad"),
    ("dp2xring2", "qwen3_5", "packed"),
    ("usp2x2", "f64:qwen3_next", "packed"),
    ("ring4", "f64:nemotron_h", "packed"),
    ("usp2x2", "lora:qwen3_5", "packed"),
]
CASES_W3 = [  # odd sizes: 3 ranks (shards of 160 / 6 ~ 27 tokens: rows padded to a multiple of 6)
    ("ring3", "qwen3_next", "packed"),
    ("ring3scan", "qwen3_5", "pad"),
    ("ring3", "nemotron_h", "packed"),
    ("ring3", "f64:qwen3_5", "packed"),
]


def test_hybrid_world2_fast():
    """Gated DeltaNet (Qwen3-Next MoE, Qwen3.5) and Mamba2 (Nemotron-H, Bamba) under Ulysses 2 and ring 2 (chain
    and scan), fp32 and float64; refusals on both ranks."""
    _assert_results(run_distributed(world_cases, 2, CASES_W2, refusals=True, timeout=600))


@pytest.mark.slow
def test_hybrid_world2_more():
    """The other archs and layouts at world 2 (Qwen3.5-MoE, Granite 4, contiguous ring), LoRA (peft, all-linear)
    under ring and Ulysses: adapter gradients vs the unsharded PeftModel."""
    _assert_results(run_distributed(world_cases, 2, CASES_W2_SLOW, timeout=900))


@pytest.mark.slow
def test_hybrid_world4():
    _assert_results(run_distributed(world_cases, 4, CASES_W4, refusals=True, timeout=1500))


@pytest.mark.slow
def test_hybrid_world3_odd():
    _assert_results(run_distributed(world_cases, 3, CASES_W3, timeout=900))


def _mesh(ulysses: int, ring: int) -> SequenceParallelMesh:
    """A mesh description without process groups: enough for apply-time checks (they never communicate)."""
    return SequenceParallelMesh(dp_size=1, ring_degree=ring, ulysses_degree=ulysses, layout="zigzag")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1",
                                  "zamba2", "jamba", "lfm2", "falcon_mamba", "mamba", "olmo_hybrid",
                                  "kimi_linear", "minimax", "recurrent_gemma"])
@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 2), (1, 3)])
def test_ring_and_usp_accepted(arch, ulysses, ring):
    """Ring and USP meshes are no longer refused for hybrids: every recurrent layer gets the SP forward."""
    from seqpar.hf.recurrent_layers import find_recurrent

    model = apply_sequence_parallel(tiny_model(arch), _mesh(ulysses, ring))
    layers = find_recurrent(model)[0]
    assert layers and all("forward" in m.__dict__ for m in layers)


def test_bad_key_head_count_refused():
    model = tiny_model("qwen3_next")  # 4 k heads: Ulysses 3 cannot split them
    with pytest.raises(SeqParError, match=r"4 key heads .* Ulysses degree 3 does not divide.*\[1, 2, 4\]"):
        apply_sequence_parallel(model, _mesh(3, 1))
    assert "forward" not in model.model.layers[0].linear_attn.__dict__  # nothing was changed


def test_bad_mamba2_head_count_refused():
    """8 Mamba2 heads in 2 groups: Ulysses 1 / 2 / 4 / 8 can split them (4 and 8: each group's B / C go to several
    ranks); 3 cannot, nor can 2 split 6 heads in 3 groups."""
    with pytest.raises(SeqParError, match=r"8 Mamba2 heads in 2 groups, which the Ulysses degree 3 cannot split.*"
                                          r"\[1, 2, 4, 8\].*size: 6, ulysses_degree: 2"):
        apply_sequence_parallel(tiny_model("nemotron_h"), _mesh(3, 2))
    with pytest.raises(SeqParError, match=r"6 Mamba2 heads in 3 groups, which the Ulysses degree 2 cannot.*"
                                          r"\[1, 3, 6\]"):
        apply_sequence_parallel(tiny_model("nemotron_h", mamba_num_heads=6, n_groups=3), _mesh(2, 1))
    apply_sequence_parallel(tiny_model("nemotron_h"), _mesh(4, 1))


def test_auto_degrees_for_hybrids():
    """Automatic degrees bound Ulysses by BOTH layer kinds' heads (and the node), the rest ring (state passing):
    no more forced pure Ulysses. Tiny Qwen3-Next: 4 q / 2 kv softmax heads, 4 linear k heads; tiny Nemotron-H:
    4 q / 2 kv, 8 Mamba2 heads in 2 groups."""
    from seqpar.hf import tiny_config
    from seqpar.mesh import RecurrentHeads, auto_degrees, recurrent_heads
    from seqpar.train.config import config_from_dict, validate_for_launch
    from seqpar.train.model.load import model_heads, model_recurrent_heads

    assert recurrent_heads(tiny_config("qwen3_next")) == RecurrentHeads("gated_deltanet", 4)
    assert recurrent_heads(tiny_config("qwen3_5")) == RecurrentHeads("gated_deltanet", 4)
    assert recurrent_heads(tiny_config("nemotron_h")) == RecurrentHeads("mamba2", 8, 2)
    assert recurrent_heads(tiny_config("granitemoehybrid")) == RecurrentHeads("mamba2", 8, 2)
    assert recurrent_heads(tiny_config("falcon_h1")) == RecurrentHeads("mamba2", 8, 2)  # layer_types "hybrid"
    assert recurrent_heads(tiny_config("zamba2")) == RecurrentHeads("mamba2", 8, 2)
    assert recurrent_heads(tiny_config("kimi_linear")) == RecurrentHeads("gated_deltanet", 4)
    assert recurrent_heads(tiny_config("llama")) is None
    gdn, m2 = RecurrentHeads("gated_deltanet", 4), RecurrentHeads("mamba2", 8, 2)
    assert auto_degrees(4, 4, 2, recurrent=gdn) == (2, 2)  # the kv heads bound it, not the recurrence
    assert auto_degrees(8, 16, 16, recurrent=gdn) == (4, 2)  # the 4 linear k heads bound it
    assert auto_degrees(8, 16, 16, recurrent=gdn, node_size=2) == (2, 4)  # ... and the node
    assert auto_degrees(8, 8, 8, recurrent=m2) == (8, 1)  # 8 heads, 2 groups: a multiple of the groups is fine
    assert auto_degrees(8, 8, 8, recurrent=RecurrentHeads("mamba2", 12, 3)) == (1, 8)  # 2, 4, 8: no split of 3 groups
    assert seqpar.init_mesh(1, model_config=tiny_config("qwen3_next")).sp_size == 1
    for arch, sp, want in (("qwen3_next", 4, (2, 2)), ("nemotron_h", 4, (2, 2)), ("qwen3_5", 8, (2, 4))):
        cfg = config_from_dict({"model": {"name": f"tiny:{arch}"}, "sequence_parallel": sp, "output_dir": "out",
                                "dataset": {"path": "x.jsonl", "max_length": 128}})
        nh, nkv = model_heads(cfg)
        rec = model_recurrent_heads(cfg)
        assert rec is not None and validate_for_launch(cfg, sp, num_heads=nh, num_kv_heads=nkv, recurrent=rec) == want
    bad = config_from_dict({"model": {"name": "tiny:nemotron_h"}, "output_dir": "out",
                            "sequence_parallel": {"size": 6, "ulysses_degree": 3},
                            "dataset": {"path": "x.jsonl", "max_length": 144}})
    with pytest.raises(SeqParError, match=r"mamba2 layers with 8 heads in 2 groups, which ulysses_degree=3 cannot "
                                          r"split: use a ulysses_degree among \[1, 2\]"):
        validate_for_launch(bad, 6, num_heads=4, num_kv_heads=2, recurrent=model_recurrent_heads(bad))


def test_router_aux_loss_refused():
    with pytest.raises(SeqParError, match="output_router_logits"):
        apply_sequence_parallel(tiny_model("qwen3_next", output_router_logits=True), _mesh(2, 1))


def test_other_mixers_still_refused():
    """Only the supported Gated DeltaNet classes pass: an unknown linear-attention module is still refused."""
    model = tiny_model("qwen3_next")

    class MyLinearAttention(torch.nn.Module):
        def forward(self, x):
            return x

    model.model.layers[1].extra = MyLinearAttention()
    with pytest.raises(SeqParError, match="MyLinearAttention"):
        apply_sequence_parallel(model, _mesh(2, 1))


def test_sp1_in_process_and_remove():
    """SP=1 (no process group) runs the seqpar forward; remove_sequence_parallel restores upstream's."""
    torch.manual_seed(0)
    _assert_results([[(("sp1", a, "packed"), run_case(seqpar.init_mesh(1), a, "packed"))
                      for a in ("qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid")]])
    model = apply_sequence_parallel(tiny_model("qwen3_5"), seqpar.init_mesh(1))
    layer = model.model.layers[0].linear_attn
    assert "forward" in layer.__dict__
    remove_sequence_parallel(model)
    assert "forward" not in layer.__dict__


def _verify_data(tmp_path, stage: str):
    import json

    g = torch.Generator().manual_seed(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    def phrase(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    data = tmp_path / f"{stage}.jsonl"
    rows = ({"prompt": phrase(4), "chosen": phrase(6), "rejected": phrase(7)} if stage == "dpo"
            else {"instruction": phrase(4), "response": phrase(8)} for _ in range(16))
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _verify(tmp_path, arch: str, sp, nproc: int, stage: str = "sft", fsdp: bool = False, ckpt: bool = False,
            steps: int = 3):
    """`seqpar verify`: train under SP vs the SP=1 reference run, `steps` steps, packed rows; losses and step-1
    gradients within 1e-5."""
    from procs import run_verify

    cfg = {"model": {"name": f"tiny:{arch}"}, "stage": stage, "micro_batch_size": 1, "grad_accum": 2,
           "dataset": {"path": str(_verify_data(tmp_path, stage)), "max_length": 128, "packing": stage == "sft"},
           "sequence_parallel": sp, "max_steps": steps, "optimizer": {"lr": 1e-2},
           "output_dir": str(tmp_path / "run"), "progress": False, "fsdp": fsdp,
           "memory": {"activation_checkpointing": ckpt}}
    rep = run_verify(cfg, tmp_path, steps=steps, nproc=nproc, timeout=900)
    assert rep["passed"] and rep["max_abs_dloss"] <= 1e-5 and len(rep["steps"]) == steps, rep
    assert rep["grads_passed"] and rep["max_abs_dgrad_step1"] <= 1e-5, rep
    return rep


def test_cli_verify_hybrid_ring_checkpointing(tmp_path):
    """`seqpar verify` on tiny:nemotron_h (Mamba2) under a ring of 2 with activation checkpointing: the state
    passing runs again in every layer's recompute (2 steps)."""
    _verify(tmp_path, "nemotron_h", {"size": 2, "ring_degree": 2}, 2, ckpt=True, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch,sp,nproc,stage,fsdp,ckpt", [
    ("qwen3_next", 2, 2, "sft", False, False),  # auto degrees: ulysses 2 (its 2 kv heads)
    ("qwen3_next", {"size": 2, "ring_degree": 2, "state_passing": "scan"}, 2, "sft", True, True),
    ("qwen3_5", {"size": 2, "ring_degree": 2}, 2, "dpo", False, False),
    ("nemotron_h", {"size": 2, "ring_degree": 2}, 2, "dpo", True, False),
    ("qwen3_5", 4, 4, "sft", True, True),  # auto degrees: ulysses 2 x ring 2 (USP)
    ("granitemoehybrid", {"size": 4, "ring_degree": 4}, 4, "sft", False, True),
    ("lfm2", {"size": 2, "ring_degree": 2}, 2, "sft", True, True),
    ("lfm2", 4, 4, "dpo", False, False),  # auto degrees: ulysses 2 x ring 2 (USP)
    ("falcon_h1", {"size": 2, "ring_degree": 2}, 2, "dpo", True, True),
    ("falcon_h1", 4, 4, "sft", False, False),  # auto degrees: ulysses 2 x ring 2 (USP)
    ("zamba2", {"size": 2, "ring_degree": 2}, 2, "sft", True, True),
    ("zamba2", {"size": 4, "ulysses_degree": 2}, 4, "dpo", False, False),
    ("jamba", {"size": 2, "ring_degree": 2, "state_passing": "scan"}, 2, "sft", True, True),
    ("jamba", 4, 4, "dpo", False, False),  # auto degrees: ulysses 2 x ring 2 (USP)
    ("falcon_mamba", {"size": 2, "ring_degree": 2}, 2, "dpo", True, True),
    ("mamba", {"size": 4, "ulysses_degree": 2}, 4, "sft", False, False),
    ("olmo_hybrid", {"size": 2, "ring_degree": 2}, 2, "sft", True, True),
    ("olmo_hybrid", 4, 4, "dpo", False, False),  # auto degrees: ulysses 2 x ring 2 (USP)
    ("kimi_linear", {"size": 2, "ring_degree": 2}, 2, "dpo", True, True),
    ("kimi_linear", {"size": 4, "ulysses_degree": 2}, 4, "sft", False, False),
    ("minimax", {"size": 2, "ring_degree": 2, "state_passing": "scan"}, 2, "sft", True, True),
    ("minimax", 4, 4, "dpo", False, False),  # auto degrees: ulysses 2 x ring 2 (USP)
    ("recurrent_gemma", {"size": 2, "ring_degree": 2}, 2, "dpo", True, True),
    ("recurrent_gemma", 4, 4, "sft", False, False),  # auto degrees: ulysses 2 x ring 2 (USP)
], ids=["qwen3_next-auto", "qwen3_next-ring-scan-fsdp-ckpt", "qwen3_5-ring-dpo", "nemotron_h-ring-dpo-fsdp",
        "qwen3_5-usp-fsdp-ckpt", "granite-ring4-ckpt", "lfm2-ring-fsdp-ckpt", "lfm2-usp-dpo",
        "falcon_h1-ring-dpo-fsdp-ckpt", "falcon_h1-usp", "zamba2-ring-fsdp-ckpt", "zamba2-usp-dpo",
        "jamba-ring-scan-fsdp-ckpt", "jamba-usp-dpo", "falcon_mamba-ring-dpo-fsdp-ckpt", "mamba-usp",
        "olmo_hybrid-ring-fsdp-ckpt", "olmo_hybrid-usp-dpo", "kimi_linear-ring-dpo-fsdp-ckpt", "kimi_linear-usp",
        "minimax-ring-scan-fsdp-ckpt", "minimax-usp-dpo", "recurrent_gemma-ring-dpo-fsdp-ckpt",
        "recurrent_gemma-usp"])
def test_cli_verify_hybrids(tmp_path, arch, sp, nproc, stage, fsdp, ckpt):
    """`seqpar verify` (SFT and DPO) on the hybrids under Ulysses, ring and USP, with FSDP2 (the recurrent
    forwards slice the gathered conv1d / A_log / dt_bias / D parameters) and activation checkpointing. Zamba2: 2
    steps: its A_log / dt_bias gradients are ~1e-9 to 1e-5 (dt starts near time_step_min), which Adam turns into
    full-size updates whose fp32 rounding differs; the third step's loss drifts to ~3e-5 in fp32 while SP is exact
    in float64 (tests/test_hf_hybrid_families.py, 1e-10)."""
    _verify(tmp_path, arch, sp, nproc, stage, fsdp, ckpt, steps=2 if arch == "zamba2" else 3)
