"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5 text: Gated DeltaNet + gated softmax attention) under SP.

The SP model (seqpar collator -> apply_sequence_parallel -> seqpar.loss, gradients summed over the
ranks) is compared with an independent single-process reference: the plain HF model run on every
row / every packed document on its own, unpadded, with a hand-written shift + CE. Compared: loss,
EVERY parameter gradient (Gated DeltaNet conv1d / A_log / dt_bias / norm, MoE experts and router
included), the logits of every real token. Tolerance: fp32, 1e-5 absolute on loss and gradients,
2e-5 on logits (values ~1-5). Sequences are longer than the recurrence's 64-token chunk, and packed
documents have boundaries inside shards (documents of 70 / 37 / 23 / 30 tokens on 80- or 40-token shards).

Refusals (ring / USP, k heads the Ulysses degree does not divide, the MoE aux loss) are checked in
process, and once in a spawned world (every rank raises alike, before any collective: nothing hangs).
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelCollator
from seqpar.errors import SeqParError
from seqpar.hf import apply_sequence_parallel, remove_sequence_parallel, tiny_model
from seqpar.mesh import SequenceParallelMesh
from seqpar.spawn import run_distributed

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
LOGIT_TOL = 2e-5
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
    """LoRA on every Linear (Gated DeltaNet projections included), B initialised randomly so A gets gradients."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def run_case(mesh, arch: str, kind: str, seed: int = 0) -> dict:
    """Errors of one case on this rank: loss, max gradient, logits; SP vs the single-process reference.

    arch "lora:<arch>": LoRA adapters (peft) on both models, SP applied to the PeftModel."""
    lora = arch.startswith("lora:")
    arch = arch.removeprefix("lora:")
    ref = tiny_model(arch, seed=seed).train()
    sp = tiny_model(arch, seed=seed)
    if lora:
        ref, sp = _lora(ref, seed + 7), _lora(sp, seed + 7)
    sp = apply_sequence_parallel(sp, mesh).train()
    n_linear = sum(1 for m in sp.modules() if "forward" in m.__dict__)
    assert n_linear >= 1, "no Gated DeltaNet layer got the SP forward"
    rows = _rows(kind, 100 + seed, mesh.dp_size)
    want, ref_logits = _reference(ref, rows)
    want.backward()
    batch = SequenceParallelCollator(mesh, pad_token_id=0, packing=(kind == "packed"))(rows[mesh.dp_rank])
    kw = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    if "cu_seqlens" in batch:
        kw["cu_seqlens"] = batch["cu_seqlens"]
    logits = sp(**kw).logits
    num = L.global_token_count(batch["num_supervised_tokens"], mesh)
    share = L.sft_loss(logits, batch["shift_labels"], num)
    share.backward()
    got = L.global_loss(share, mesh)
    L.sum_gradients(sp.parameters(), mesh)
    full = seqpar.unshard(logits.detach(), mesh, 1)
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
        assert any("lora_A" in n and "linear_attn" in n and float(g.abs().max()) > 0 for n, g in gs.items())
    return {
        "loss": abs(float(got) - float(want.detach())),
        "grad": max(float((gs[k].double() - gr[k].double()).abs().max()) for k in gs),
        "logits": lerr,
        "no_grad": missing,  # parameters the SP forward never used (experts may legitimately get no token)
        "value": float(want.detach()),
    }


MODES = {"ulysses2": (2, 2, 1), "ulysses4": (4, 4, 1), "dp2xulysses2": (2, 2, 1), "sp1": (1, 1, 1)}


def world_cases(cases, refusals: bool = False):
    meshes, out = {}, []
    for mode, arch, kind in cases:
        if mode not in meshes:
            sp, u, r = MODES[mode]
            meshes[mode] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        out.append(((mode, arch, kind), run_case(meshes[mode], arch, kind)))
    if refusals:  # every rank must raise the same error at apply time, before communicating
        world = torch.distributed.get_world_size()
        msgs = []
        for mesh, kw in ((seqpar.init_mesh(world, ulysses_degree=1, ring_degree=world), {}),
                         (seqpar.init_mesh(world, ulysses_degree=world, ring_degree=1),
                          {"linear_num_key_heads": 3, "linear_num_value_heads": 6})):
            try:
                apply_sequence_parallel(tiny_model("qwen3_next", **kw), mesh)
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
                assert "ring_degree=1" in r["messages"][0], r["messages"]
                assert "does not divide" in r["messages"][1] and "[1, 3]" in r["messages"][1], r["messages"]
                assert r["messages"] == per_rank[0][-1][1]["messages"]  # identical on every rank
                continue
            every.append(r)
            if not (r["loss"] <= LOSS_TOL and r["grad"] <= GRAD_TOL and r["logits"] <= LOGIT_TOL) or r["no_grad"]:
                bad.append((rank, key, r))
    assert not bad, "SP != no-SP:\n" + "\n".join(map(str, bad))
    worst = {k: max(r[k] for r in every) for k in ("loss", "grad", "logits")}
    print(f"{len(every)} case-ranks, worst errors: {worst}")  # shown with pytest -s


CASES_W2 = [
    ("ulysses2", "qwen3_next", "pad"),
    ("ulysses2", "qwen3_next", "packed"),
    ("ulysses2", "qwen3_5", "packed"),
    ("ulysses2", "qwen3_5_moe", "packed"),
]
CASES_W2_LORA = [("ulysses2", "lora:qwen3_next", "packed"), ("ulysses2", "lora:qwen3_5", "pad")]
CASES_W4 = [
    ("ulysses4", "qwen3_next", "pad"),
    ("ulysses4", "qwen3_next", "packed"),
    ("ulysses4", "qwen3_5", "pad"),
    ("ulysses4", "qwen3_5", "packed"),
    ("ulysses4", "qwen3_5_moe", "pad"),
    ("dp2xulysses2", "qwen3_next", "packed"),
]


def test_hybrid_world2_fast():
    """Qwen3-Next (MoE) unpacked B=2 and packed, Qwen3.5 packed, under Ulysses 2; refusals on both ranks."""
    _assert_results(run_distributed(world_cases, 2, CASES_W2, refusals=True, timeout=400))


@pytest.mark.slow
def test_hybrid_world4():
    _assert_results(run_distributed(world_cases, 4, CASES_W4, refusals=True, timeout=900))


@pytest.mark.slow
def test_hybrid_world2_qwen3_5_pad_and_lora():
    """Qwen3.5 unpacked; LoRA (peft, all-linear) on both hybrids: adapter gradients vs the unsharded PeftModel."""
    cases = [("ulysses2", "qwen3_5", "pad"), *CASES_W2_LORA]
    _assert_results(run_distributed(world_cases, 2, cases, timeout=600))


def _mesh(ulysses: int, ring: int) -> SequenceParallelMesh:
    """A mesh description without process groups: enough for apply-time checks (they never communicate)."""
    return SequenceParallelMesh(dp_size=1, ring_degree=ring, ulysses_degree=ulysses, layout="zigzag")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 2), (1, 4)])
def test_ring_and_usp_refused(arch, ulysses, ring):
    with pytest.raises(SeqParError, match=r"need the full sequence on one rank: use ring_degree=1 / pure Ulysses"):
        apply_sequence_parallel(tiny_model(arch), _mesh(ulysses, ring))


def test_bad_key_head_count_refused():
    model = tiny_model("qwen3_next")  # 4 k heads: Ulysses 3 cannot split them
    with pytest.raises(SeqParError, match=r"4 key heads .* Ulysses degree 3 does not divide.*\[1, 2, 4\]"):
        apply_sequence_parallel(model, _mesh(3, 1))
    assert "forward" not in model.model.layers[0].linear_attn.__dict__  # nothing was changed


def test_auto_degrees_are_pure_ulysses_for_linear_attention():
    from seqpar.hf import tiny_config
    from seqpar.mesh import auto_degrees, needs_full_sequence
    from seqpar.train.config import config_from_dict, validate_for_launch
    from seqpar.train.model.load import model_needs_full_sequence

    assert needs_full_sequence(tiny_config("qwen3_next")) and needs_full_sequence(tiny_config("qwen3_5"))
    assert not needs_full_sequence(tiny_config("llama"))
    assert auto_degrees(4, 4, 2) == (2, 2) and auto_degrees(4, 4, 2, ulysses_only=True) == (4, 1)
    cfg = config_from_dict({"model": {"name": "tiny:qwen3_next"}, "dataset": {"path": "x.jsonl", "max_length": 128},
                            "sequence_parallel": 4, "output_dir": "out"})
    assert model_needs_full_sequence(cfg)
    heads = tiny_config("qwen3_next")
    assert validate_for_launch(cfg, 4, num_heads=heads.num_attention_heads, num_kv_heads=heads.num_key_value_heads,
                               ulysses_only=True) == (4, 1)


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
                      for a in ("qwen3_next", "qwen3_5")]])
    model = apply_sequence_parallel(tiny_model("qwen3_5"), seqpar.init_mesh(1))
    layer = model.model.layers[0].linear_attn
    assert "forward" in layer.__dict__
    remove_sequence_parallel(model)
    assert "forward" not in layer.__dict__


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_cli_verify_tiny_qwen3_next(tmp_path, fsdp):
    """`seqpar verify` (train SP=2 Ulysses vs the SP=1 reference, 3 steps, packed rows) on tiny:qwen3_next;
    with FSDP the Gated DeltaNet forward slices the gathered conv1d / A_log / dt_bias parameters."""
    import json

    from procs import run_verify

    g = torch.Generator().manual_seed(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    def phrase(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"instruction": phrase(4), "response": phrase(8)}) + "\n" for _ in range(16)))
    cfg = {"model": {"name": "tiny:qwen3_next"}, "dataset": {"path": str(data), "max_length": 128, "packing": True},
           # auto degrees (no FSDP case) must pick pure Ulysses for a model with linear attention
           "sequence_parallel": {"size": 2, "ring_degree": 1} if fsdp else 2, "micro_batch_size": 1, "grad_accum": 2,
           "max_steps": 3, "optimizer": {"lr": 1e-2}, "output_dir": str(tmp_path / "run"), "progress": False,
           "fsdp": fsdp}
    rep = run_verify(cfg, tmp_path, steps=3)
    assert rep["passed"] and rep["max_abs_dloss"] <= 1e-5 and len(rep["steps"]) == 3, rep
    assert rep["grads_passed"] and rep["max_abs_dgrad_step1"] <= 1e-5, rep
