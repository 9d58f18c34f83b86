"""Activation checkpointing and tiled MLP: exact under every SP mode, and they really save memory.

Equivalence: each case runs the same global batch
- through an independent single-process reference: the plain HF model (no SP, no memory feature) on every
  row / packed document separately, hand-written CE or DPO formula (tests/test_hf_equivalence.py);
- through the SP model WITHOUT the features, and through the SP model WITH them (the trainer's order: SP
  attention -> LoRA -> checkpointing / tiled MLP -> FSDP2), via seqpar.steps.micro_batch_loss.
  Between the featured forward and its backward, another forward of a different batch (other lengths)
  runs under no_grad, so a recompute that used the model's latest plan instead of its own would fail.
Compared: loss and every parameter gradient (summed over dp x sp, or FSDP2's full gradients), featured SP
vs reference within 1e-5 and featured SP vs featureless SP within 1e-6 (fp32). One spawned world per world
size runs many cases; the full arch grid is `slow`.

Memory: saved-tensor bytes with checkpointing stay within the layer inputs' budget (and the same check
fails without it); a TorchDispatchMode sees no [B, S_local, intermediate] tensor with tiled MLP in forward
or backward (and does see one without it).
"""

from __future__ import annotations

import json

import pytest
import torch
from procs import SFT_ROWS_SCRIPT, check_same_training, plain_and_sp
from test_hf_equivalence import _ref_dpo, _ref_sft
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelCollator, SequenceParallelDPOCollator
from seqpar.errors import SeqParError
from seqpar.hf import ARCHS, apply_sequence_parallel, tiny_model
from seqpar.memory.checkpointing import enable_activation_checkpointing, is_activation_checkpointing
from seqpar.memory.offload import offload_store
from seqpar.memory.tiled_mlp import TiledForward, apply_tiled_mlp, auto_tile_count, decoder_mlps, remove_tiled_mlp
from seqpar.spawn import run_distributed
from seqpar.steps import ReferenceLogps, StepSpec, forward_logits, micro_batch_loss

REF_TOL = 1e-5  # featured SP vs the independent plain-HF reference
# featured SP vs the same SP run without the features: fp32 rounding of reordered sums (tiles, offload) only; the
# worst measured, 1.55e-6, is a DPO loss (~1.26) at USP 2 x 2 with LoRA, checkpointing, offload and 2 tiles
SELF_TOL = 2e-6
VOCAB = 160
HEADS = (4, 2)  # head_dim 8 -> hidden 32, intermediate 128: auto tiling kicks in above 32 local tokens
LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]  # an MLP projection too: LoRA inside the tiles
BETA, GAMMA = 0.5, 0.3


# ----------------------------------------------------------------------------- batches
def _rows(kind: str, seed: int, n_dp: int) -> list[list[dict]]:
    """Per dp rank, its rows. Lengths: ~70-90 tokens, different per dp rank (different tile counts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in range(n_dp):
        rows = []
        if kind == "pad":  # B=2, right-padded, prompt part unsupervised
            for n in (71 + 13 * d, 46):
                ids = torch.randint(3, VOCAB, (n,), generator=g)
                labels = ids.clone()
                labels[: int(torch.randint(1, n // 2, (1,), generator=g))] = -100
                rows.append({"input_ids": ids, "labels": labels})
        elif kind == "packed":  # one packed row of documents: 60 tokens on dp 0, 88 on dp 1
            for n in ((21, 27, 12) if d % 2 == 0 else (21, 40, 12, 15)):
                ids = torch.randint(3, VOCAB, (n,), generator=g)
                labels = ids.clone()
                labels[:2] = -100
                rows.append({"input_ids": ids, "labels": labels})
        elif kind == "dpo":  # short completions: fp32 sums of long log-prob rows alone differ by ~1e-5
            for p, c, r in ((9, 14, 10), (6, 9, 16 + 3 * d)):
                rows.append({f"{k}_input_ids": torch.randint(3, VOCAB, (n,), generator=g)
                             for k, n in (("prompt", p), ("chosen", c), ("rejected", r))})
        else:
            raise ValueError(kind)
        out.append(rows)
    return out


def _collate(mesh, kind: str, rows: list[dict]) -> dict:
    if kind == "dpo":
        return SequenceParallelDPOCollator(mesh, pad_token_id=0)(rows)
    return SequenceParallelCollator(mesh, pad_token_id=0, packing=(kind == "packed"))(rows)


# ----------------------------------------------------------------------------- models
def _lora(model, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, bias="none"))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-zero B, so the policy differs from its adapter-disabled reference
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _model(arch: str, seed: int, lora: bool, mesh=None, feats: dict | None = None, fsdp: bool = False):
    m = tiny_model(arch, *HEADS, vocab_size=VOCAB, seed=seed)
    if mesh is not None:
        apply_sequence_parallel(m, mesh)
    if lora:
        m = _lora(m, seed)
    feats = feats or {}
    if feats.get("ckpt"):
        enable_activation_checkpointing(m, offload=feats.get("offload", False), keep_attention=feats.get("keep", False))
        assert is_activation_checkpointing(m)
    if feats.get("tiles"):
        assert apply_tiled_mlp(m, feats["tiles"]) == 2
    m.train()
    if fsdp:
        from seqpar.train.model.build import apply_fsdp

        apply_fsdp(m, torch.device("cpu"), torch.distributed.get_world_size(), bf16=False)
    return m


def _full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ----------------------------------------------------------------------------- one case on one rank
def _sp_run(mesh, arch, kind, rows, seed, lora, feats, fsdp, other_rows=None):
    """(global loss, full gradients) of one SP step; other_rows: a no_grad forward between forward and backward."""
    model = _model(arch, seed, lora, mesh, feats, fsdp)
    spec = StepSpec("dpo", BETA, "sigmoid", GAMMA) if kind == "dpo" else StepSpec("sft")
    reference = None
    if kind == "dpo":  # LoRA: the policy itself with its adapter disabled (checkpointed layers, train mode, no_grad)
        reference = (ReferenceLogps(mesh, policy=model) if lora else
                     ReferenceLogps(mesh, ref_model=apply_sequence_parallel(
                         tiny_model(arch, *HEADS, vocab_size=VOCAB, seed=seed + 1), mesh).eval()))
    batch = _collate(mesh, kind, rows)
    key = "num_pairs" if kind == "dpo" else "num_supervised_tokens"
    num = L.global_token_count(torch.as_tensor(batch[key]), mesh)
    share, _ = micro_batch_loss(model, batch, num, mesh, spec, reference)
    if other_rows is not None:
        with torch.no_grad():
            forward_logits(model, _collate(mesh, kind, other_rows))
    factor = L.gradient_reduction_factor(mesh) if fsdp else 1.0
    (share * factor).backward()
    if not fsdp:
        L.sum_gradients(model.parameters(), mesh)
    store = offload_store(model)  # activation offload: how many layer inputs went to the host store
    return (float(L.global_loss(share.detach(), mesh)), _full_grads(model), int(batch["input_ids"].shape[1]),
            store.packed_tensors if store is not None else 0)


def run_case(mesh, arch, kind, feats, lora=False, fsdp=False, seed=0):
    rows = _rows(kind, 100 + seed, mesh.dp_size)
    other = _rows(kind, 200 + seed, mesh.dp_size)
    other[mesh.dp_rank] = other[mesh.dp_rank][:1]  # a different length and batch size
    ref = _model(arch, seed, lora)
    if kind == "dpo":
        base = tiny_model(arch, *HEADS, vocab_size=VOCAB, seed=seed) if lora else \
            tiny_model(arch, *HEADS, vocab_size=VOCAB, seed=seed + 1)
        want = _ref_dpo(ref, base.eval(), rows, "sigmoid", BETA, GAMMA)
    else:
        want, _, _ = _ref_sft(ref, rows)
    want.backward()
    g_ref = _full_grads(ref)
    mine = rows[mesh.dp_rank]
    base_feats = {"ckpt": True} if feats.get("offload") else {}  # offload is compared with checkpointing alone
    loss0, g0, _, _ = _sp_run(mesh, arch, kind, mine, seed, lora, base_feats, fsdp)
    loss1, g1, s_local, offloaded = _sp_run(mesh, arch, kind, mine, seed, lora, feats, fsdp,
                                            other_rows=other[mesh.dp_rank])
    tiles = feats.get("tiles")
    return {
        "ref_loss": abs(loss1 - float(want.detach())), "ref_grad": _max_diff(g1, g_ref),
        "self_loss": abs(loss1 - loss0), "self_grad": _max_diff(g1, g0),
        "base_ref_grad": _max_diff(g0, g_ref), "value": float(want.detach()),
        "tiles": 0 if not tiles else (auto_tile_count(s_local, 32) if tiles is True else tiles),
        "offloaded": offloaded,
    }


# mode -> (sp, ulysses, ring); dp = world // sp
MODES = {"sp1": (1, 1, 1), "ulysses2": (2, 2, 1), "ring2": (2, 1, 2), "usp2x2": (4, 2, 2),
         "dp2xring2": (2, 1, 2), "dp2xulysses2": (2, 2, 1)}
CK, AUTO, BOTH = {"ckpt": True}, {"tiles": True}, {"ckpt": True, "tiles": True}


def world_cases(cases):
    torch.set_num_threads(1)
    meshes, out = {}, []
    for mode, arch, kind, feats, opts in cases:
        if mode not in meshes:
            sp, u, r = MODES[mode]
            meshes[mode] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        out.append(((mode, arch, kind, str(feats), str(opts)), run_case(meshes[mode], arch, kind, feats, **opts)))
    return out


def _assert_results(per_rank) -> dict:
    bad = []
    for rank, results in enumerate(per_rank):
        for key, r in results:
            if not (r["ref_loss"] <= REF_TOL and r["ref_grad"] <= REF_TOL and r["self_loss"] <= SELF_TOL
                    and r["self_grad"] <= SELF_TOL):
                bad.append((rank, key, r))
    assert not bad, "memory features changed the result:\n" + "\n".join(map(str, bad))
    every = [r for results in per_rank for _, r in results]
    worst = {k: max(r[k] for r in every) for k in ("ref_loss", "ref_grad", "self_loss", "self_grad")}
    print(f"{len(every)} case-ranks, worst errors: {worst}")  # shown with pytest -s
    return worst


KEEP = {"ckpt": True, "keep": True}  # checkpointing that keeps the attention kernels' outputs
FAST_W2 = [
    ("ulysses2", "llama", "packed", CK, {}),
    ("ring2", "qwen3", "pad", BOTH, {}),
    ("ring2", "mistral", "pad", {"tiles": 3}, {}),
    ("ulysses2", "phi3", "packed", {"ckpt": True, "tiles": 2}, {"lora": True}),
    ("ring2", "gemma3", "dpo", {"ckpt": True, "tiles": 2}, {"lora": True}),
    ("ulysses2", "llama", "packed", KEEP, {}),
    ("ring2", "qwen3", "dpo", {**KEEP, "tiles": 2}, {"lora": True}),
]
FAST_W4 = [
    ("usp2x2", "llama", "pad", {"ckpt": True, "tiles": 2}, {}),
    ("dp2xring2", "qwen2", "packed", BOTH, {"fsdp": True}),
    ("dp2xulysses2", "gemma2", "pad", BOTH, {"lora": True}),
    ("usp2x2", "qwen2", "packed", KEEP, {}),
]


def test_memory_features_world2_fast():
    res = run_distributed(world_cases, 2, FAST_W2, timeout=600)
    _assert_results(res)
    assert res[0][1][1]["tiles"] >= 2  # auto tiling really tiled (S_local > hidden_size)


def test_memory_features_world4_fast():
    """USP 2x2, dp2 x ring2 under FSDP2 (dp ranks with different row lengths -> different tile counts), LoRA."""
    res = run_distributed(world_cases, 4, FAST_W4, timeout=600)
    _assert_results(res)
    tiles = {rank: results[1][1]["tiles"] for rank, results in enumerate(res)}
    assert tiles[0] != tiles[2], tiles  # dp 0 and dp 1 ran different numbers of tiles, no hang


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_memory_features_full_grid(world):
    modes = {2: ["ulysses2", "ring2"], 4: ["usp2x2", "dp2xring2"]}[world]
    feats = [CK, AUTO, {"tiles": 3}, BOTH]
    # DPO rows are short (one auto tile): they get 2 tiles instead of the automatic count.
    cases = [(m, a, kind, {"tiles": 2} if kind == "dpo" and feats[(i + j) % 4] is AUTO else feats[(i + j) % 4],
              {"lora": j == 1})
             for m in modes for i, a in enumerate(ARCHS) for j, kind in enumerate(("pad", "packed", "dpo"))]
    if world == 4:
        cases.append(("dp2xring2", "llama", "pad", BOTH, {"fsdp": True, "lora": True}))
    _assert_results(run_distributed(world_cases, world, cases, timeout=3000))


def test_sp1_every_arch_in_process():
    """SP=1 mesh (no process group): every arch with checkpointing + 3 tiles, LoRA on two of them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mesh = seqpar.init_mesh(1)
        results = [((a,), run_case(mesh, a, "pad", {"ckpt": True, "tiles": 3}, lora=a in ("qwen2", "phi3")))
                   for a in ARCHS]
    finally:
        torch.set_num_threads(n)
    _assert_results([results])


# ----------------------------------------------------------------------------- memory really saved
def _saved_activation_bytes(model, ids) -> int:
    """Bytes of distinct non-parameter storages saved for backward outside checkpointed regions."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, position_ids=pos).logits
    out.float().square().mean().backward()
    return sum(seen.values())


def test_checkpointing_keeps_only_layer_inputs():
    mesh = seqpar.init_mesh(1)
    ids = torch.randint(3, VOCAB, (2, 96), generator=torch.Generator().manual_seed(0))
    n_layers, hidden = 4, 32
    # Layer inputs of every layer, the final norm / lm_head inputs, small per-token statistics (RMSNorm).
    budget = (n_layers + 4) * ids.numel() * hidden * 4
    used = {}
    for on in (False, True):
        m = apply_sequence_parallel(tiny_model("llama", *HEADS, vocab_size=VOCAB, num_layers=n_layers, seed=0), mesh)
        if on:
            enable_activation_checkpointing(m)
        m.train()
        used[on] = _saved_activation_bytes(m, ids)
    assert used[True] <= budget, used
    assert used[False] > 3 * budget, used  # the check fails without checkpointing
    print(f"saved bytes without / with checkpointing: {used[False]} / {used[True]}")


class _LargestWithDim(TorchDispatchMode):
    """Largest numel of any op output having one of `dims` in its shape (forward and backward)."""

    def __init__(self, dims):
        super().__init__()
        self.dims, self.largest = set(dims), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.dims & set(t.shape):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("arch,ckpt", [("llama", False), ("phi3", False), ("qwen3", True)])
def test_tiled_mlp_never_materialises_full_intermediate(arch, ckpt):
    mesh = seqpar.init_mesh(1)
    b, s, inter = 2, 96, 128
    ids = torch.randint(3, VOCAB, (b, s), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(s)[None].expand(b, s)
    largest = {}
    for tiles in (False, 4):
        m = apply_sequence_parallel(tiny_model(arch, *HEADS, vocab_size=VOCAB, intermediate_size=inter, seed=0), mesh)
        if ckpt:
            enable_activation_checkpointing(m)
        if tiles:
            apply_tiled_mlp(m, tiles)
        m.train()
        with _LargestWithDim((inter, 2 * inter)) as mode:  # Phi3's fused gate_up_proj: 2 * intermediate
            m(input_ids=ids, position_ids=pos).logits.square().mean().backward()
        largest[tiles] = mode.largest
    full = b * s * inter
    assert largest[4] < full, largest  # tiles of 24 tokens (or a weight matrix) at most
    assert largest[False] >= full, largest  # the check fails without tiling


def _mlp_backward_peak(mlp, x, g, call) -> tuple[int, torch.Tensor]:
    """Activation peak (exact meter) of call(x).backward(g), and x's gradient."""
    from seqpar.memory.meter import PeakMemoryMeter, activation_bytes

    x = x.detach().requires_grad_(True)
    meter = PeakMemoryMeter(mlp, None, torch.device("cpu"), extra=(x, g))
    with meter.measure():
        call(x).backward(g)
    return activation_bytes(meter.last), x.grad


def test_tiled_mlp_backward_fills_one_input_gradient():
    """The tiles' input gradients go into one full-length buffer as each tile's recompute finishes: the MLP
    backward's activation peak is about 2 full-length hidden buffers below plain slices (each tile's gradient
    kept until the last tile, then summed through full-length slice_backward buffers), and the gradients
    are the untiled ones (fp32, 1e-6). Control: the plain-slices variant, written here."""
    from torch.utils.checkpoint import checkpoint

    mlp = tiny_model("llama", *HEADS, vocab_size=VOCAB, intermediate_size=64, seed=0).model.layers[0].mlp
    s, n = 4096, 64
    x = torch.randn(1, s, 32, generator=torch.Generator().manual_seed(0))
    g = torch.randn(1, s, 32, generator=torch.Generator().manual_seed(1))
    full = x.numel() * 4  # one [S, hidden] fp32 buffer

    def slices(t):
        return torch.cat([checkpoint(mlp.forward, c, use_reentrant=False) for c in t.tensor_split(n, dim=-2)], -2)

    peak_plain, grad_plain = _mlp_backward_peak(mlp, x, g, slices)
    mlp.zero_grad(set_to_none=True)
    peak_tiled, grad_tiled = _mlp_backward_peak(mlp, x, g, TiledForward(mlp.forward, n))
    tiled_w = mlp.down_proj.weight.grad.clone()
    mlp.zero_grad(set_to_none=True)
    _, grad_ref = _mlp_backward_peak(mlp, x, g, mlp.forward)
    torch.testing.assert_close(grad_tiled, grad_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_plain, grad_ref, rtol=0, atol=1e-6)
    ref_w = mlp.down_proj.weight.grad  # a sum over 4096 tokens in another order: fp32 rounding, 1e-6 of its size
    assert float((tiled_w - ref_w).abs().max()) <= 1e-6 * float(ref_w.abs().max()), float(ref_w.abs().max())
    assert peak_tiled <= peak_plain - 1.5 * full, (peak_tiled, peak_plain, full)
    # x, its gradient g for the output, the output itself, the one input-gradient buffer, and one tile's tensors
    assert peak_tiled <= 4.5 * full, (peak_tiled, peak_plain, full)


def test_tiled_mlp_tile_counts_and_state_dict():
    assert auto_tile_count(96, 32) == 3 and auto_tile_count(10, 32) == 1 and auto_tile_count(0, 32) == 1
    m = tiny_model("llama", *HEADS, vocab_size=VOCAB, seed=0)
    keys = list(m.state_dict())
    apply_tiled_mlp(m, 5)
    fwd = decoder_mlps(m)[0].forward
    assert isinstance(fwd, TiledForward) and fwd.count(torch.zeros(1, 3, 32)) == 3  # at most one per token
    apply_tiled_mlp(m, True)  # re-apply: changes the count, does not nest
    fwd = decoder_mlps(m)[0].forward
    assert fwd.tiles is None and not isinstance(fwd.orig, TiledForward)
    assert fwd.count(torch.zeros(1, 96, 32)) == 3
    assert list(m.state_dict()) == keys  # nothing replaced
    remove_tiled_mlp(m)
    assert not isinstance(decoder_mlps(m)[0].forward, TiledForward)


# ----------------------------------------------------------------------------- bad configs
def _moe_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    return MixtralForCausalLM(cfg)


def test_tiled_mlp_refuses_moe():
    with pytest.raises(SeqParError, match="memory.tiled_mlp: false"):
        apply_tiled_mlp(_moe_model(), True)
    with pytest.raises(SeqParError, match="tile count 0"):
        apply_tiled_mlp(tiny_model("llama", *HEADS, vocab_size=VOCAB), 0)


def _train_cfg(tmp_path, **over):
    from seqpar.train.config import config_from_dict

    (tmp_path / "d.jsonl").write_text(json.dumps({"instruction": "a b", "response": "c d e"}) + "\n")
    c = {"model": "tiny:llama", "dataset": {"path": str(tmp_path / "d.jsonl"), "max_length": 32},
         "output_dir": str(tmp_path / "out"), "progress": False, "max_steps": 1, **over}
    return config_from_dict(c)


def test_offload_needs_checkpointing_in_config(tmp_path):
    with pytest.raises(SeqParError, match="activation_checkpointing: true"):
        _train_cfg(tmp_path, memory={"offload_activations": True})
    with pytest.raises(SeqParError, match="keep_attention keeps attention's outputs.*activation_checkpointing: true"):
        _train_cfg(tmp_path, memory={"keep_attention": True})
    assert _train_cfg(tmp_path, memory={"activation_checkpointing": True, "keep_attention": True}).memory.keep_attention


def test_trainer_dropin_keep_attention_needs_checkpointing(tmp_path):
    from transformers import TrainingArguments

    from seqpar.hf.trainer import SequenceParallelTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(SeqParError, match="keep_attention=True.*gradient_checkpointing=True"):
        SequenceParallelTrainer(model=tiny_model("llama", *HEADS, vocab_size=VOCAB), args=args, keep_attention=True)


@pytest.mark.parametrize("ck_kwargs,tiled,match", [
    ({"use_reentrant": True}, False, "use_reentrant"),
    (None, 0, "tiled_mlp"),
    (None, "moe", "memory.tiled_mlp: false|tiled_mlp=False"),
])
def test_trainer_dropin_refusals(tmp_path, ck_kwargs, tiled, match):
    from transformers import TrainingArguments

    from seqpar.hf.trainer import SequenceParallelTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_checkpointing=True,
                             gradient_checkpointing_kwargs=ck_kwargs)
    model = _moe_model() if tiled == "moe" else tiny_model("llama", *HEADS, vocab_size=VOCAB)
    with pytest.raises(SeqParError, match=match):
        SequenceParallelTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3]}],
                                tiled_mlp=True if tiled == "moe" else tiled)


def test_trainer_dropin_checkpoint_kwargs_made_sp_safe(tmp_path):
    from transformers import TrainingArguments

    from seqpar.hf.trainer import SequenceParallelTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_checkpointing=True)
    t = SequenceParallelTrainer(model=tiny_model("llama", *HEADS, vocab_size=VOCAB), args=args,
                                train_dataset=[{"input_ids": [1, 2, 3]}], tiled_mlp=2)
    assert t.args.activation_checkpointing_kwargs == {"use_reentrant": False, "early_stop": False}
    assert isinstance(decoder_mlps(t.model)[0].forward, TiledForward)


# ----------------------------------------------------------------------------- seqpar train and the Trainer drop-in
def _train_and_reference(cases):
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    return {name: train(config_from_dict(c)).losses for name, c in cases}


def _sft_data(tmp_path):
    import random

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = random.Random(0)
    with open(tmp_path / "sft.jsonl", "w") as f:
        for _ in range(16):
            f.write(json.dumps({"instruction": " ".join(rng.choice(words) for _ in range(rng.randint(1, 6))),
                                "response": " ".join(rng.choice(words) for _ in range(rng.randint(2, 10)))}) + "\n")
    return tmp_path / "sft.jsonl"


def _train_case(path, out, sp, memory, fsdp=False, method="full"):
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(path), "max_length": 128, "packing": True},
        "finetuning": {"method": method, "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
        "sequence_parallel": sp, "fsdp": fsdp, "memory": memory, "micro_batch_size": 1, "grad_accum": 2,
        "max_steps": 3, "optimizer": {"name": "sgd", "lr": 0.5}, "output_dir": str(out), "progress": False, "seed": 0,
        "checkpoint": {"save_final": True}, "export": {"final": False},
    }


def _check_train(tmp_path, world, sp, memory, **kw):
    """`seqpar train` under SP with memory features vs the same run at SP=1 without them (playing every dp rank):
    SGD (a gradient-scale error moves its trajectory), per-step losses and the final weights within 1e-5."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.model.load import load_model
    from seqpar.train.run import train

    path = _sft_data(tmp_path)
    case = _train_case(path, tmp_path / "sp", sp, memory, **kw)
    losses = run_distributed(_train_and_reference, world, [("c", case)], timeout=500)
    ref_case = dict(case, sequence_parallel={"size": 1}, fsdp=False, memory={}, output_dir=str(tmp_path / "ref"))
    ref = train(config_from_dict(ref_case), emulate_dp=world // sp["size"]).losses
    diff = max(abs(a - b) for a, b in zip(losses[0]["c"], ref))
    assert len(ref) == 3 and diff <= 1e-5, (losses[0]["c"], ref)
    got, want = (torch.load(tmp_path / d / "final_state.pt") for d in ("sp", "ref"))
    assert got.keys() == want.keys()
    dparam = max(float((got[k] - want[k]).abs().max()) for k in want)
    # the steps moved the weights (LoRA: lora_B starts at 0, the state holds the adapters), so this is not vacuous
    init = load_model(config_from_dict(case)).state_dict()
    moved = max(float((v - init[k]).abs().max()) if k in init else float(v.abs().max())
                for k, v in want.items() if k in init or "lora_B" in k)
    assert dparam <= 1e-5 and moved > 1e-3, (dparam, moved)
    print(f"seqpar train with {memory}: max |dloss| = {diff:.2e}, max |dparam| = {dparam:.2e} after 3 SGD steps")


def test_seqpar_train_with_memory_features(tmp_path):
    """`seqpar train` (the train() loop) on a zigzag ring of 2 with checkpointing + 2 MLP tiles vs SP=1 plain."""
    _check_train(tmp_path, 2, {"size": 2, "ring_degree": 2}, {"activation_checkpointing": True, "tiled_mlp": 2})


@pytest.mark.slow
def test_seqpar_train_fsdp_lora_with_memory_features(tmp_path):
    """dp2 x ring2 under FSDP2, LoRA on attention and MLP, checkpointing + auto tiles vs SP=1 plain."""
    _check_train(tmp_path, 4, {"size": 2, "ring_degree": 2}, {"activation_checkpointing": True, "tiled_mlp": True},
                 fsdp=True, method="lora")


HF_SCRIPT = r'''
import json, sys
import torch, datasets
from transformers import Trainer, TrainingArguments
from seqpar.hf import tiny_model
from seqpar.hf.trainer import SequenceParallelTrainer

mode, out = sys.argv[1], sys.argv[2]
''' + SFT_ROWS_SCRIPT + r'''
args = TrainingArguments(output_dir=f"{out}/o", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=2, optim="sgd", learning_rate=0.1, max_grad_norm=1.0, logging_steps=1,
                         report_to=[], save_strategy="no",
                         train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True,
                         gradient_checkpointing=(mode == "sp"))
model = tiny_model("llama", 3, 1, vocab_size=64, seed=0)
if mode == "sp":
    t = SequenceParallelTrainer(model=model, args=args, train_dataset=ds, tiled_mlp=True)  # seqpar collates
else:
    t = Trainer(model=model, args=args, train_dataset=ds, data_collator=pad_collate)
t.train()
res = {"losses": [h["loss"] for h in t.state.log_history if "loss" in h],
       "grad_norms": [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h],
       "ckpt": bool(model.is_activation_checkpointing),
       "ckpt_kwargs": sorted(getattr(getattr(model.model.layers[0], "_gradient_checkpointing_func", None),
                                     "keywords", {}).items())}
if t.is_world_process_zero():
    torch.save({k: v.detach() for k, v in model.named_parameters()}, f"{out}/params.pt")
    json.dump(res, open(f"{out}/result.json", "w"))
'''


@pytest.mark.slow
def test_hf_trainer_dropin_gradient_checkpointing(tmp_path):
    """SequenceParallelTrainer(gradient_checkpointing=True, tiled_mlp=True) on a ring of 2 vs the stock Trainer
    without either, SGD: per-step losses, gradient norms and the final parameters within 1e-5; the layers were
    checkpointed non-reentrantly, whole layers."""
    plain, sp = plain_and_sp(HF_SCRIPT, tmp_path)
    assert sp["ckpt"] and not plain["ckpt"]
    assert ["early_stop", False] in sp["ckpt_kwargs"] and ["use_reentrant", False] in sp["ckpt_kwargs"]
    init = dict(tiny_model("llama", 3, 1, vocab_size=64, seed=0).named_parameters())
    check_same_training(tmp_path, plain, sp, 2, init)


def _lora_trainer_losses(out: str, ckpt: bool, user_enable: bool) -> tuple[list[float], object]:
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import TrainingArguments

    from seqpar.hf.trainer import SequenceParallelTrainer

    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_list([{"input_ids": torch.randint(3, 64, (int(n),), generator=g).tolist()}
                                     for n in torch.randint(20, 40, (8,), generator=g)])
    torch.manual_seed(0)  # the same random LoRA init in both runs
    model = get_peft_model(tiny_model("llama", 4, 2, vocab_size=64, seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False))
    if user_enable:
        model.enable_input_require_grads()  # what PEFT recipes do; the Trainer adds a second set
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             train_sampling_strategy="sequential", seed=0, gradient_checkpointing=ckpt)
    t = SequenceParallelTrainer(model=model, args=args, train_dataset=ds, sequence_parallel_size=1)
    t.train()
    return [h["loss"] for h in t.state.log_history if "loss" in h], model


def test_trainer_lora_checkpointing_drops_input_require_grads(tmp_path):
    """HF Trainer drop-in + LoRA + gradient_checkpointing: transformers' input-require-grads hooks (also a
    user's own, whose handles a second enable loses) are gone after train() enabled checkpointing, so the
    frozen embedding's output needs no gradient; the losses equal the run without checkpointing."""
    from seqpar.memory.checkpointing import is_activation_checkpointing

    plain, _ = _lora_trainer_losses(str(tmp_path / "a"), False, False)
    losses, model = _lora_trainer_losses(str(tmp_path / "b"), True, True)
    assert is_activation_checkpointing(model)
    emb = model.get_input_embeddings()
    assert not [f for f in emb._forward_hooks.values() if f.__name__ == "make_inputs_require_grads"]
    assert not emb(torch.tensor([[3, 4]])).requires_grad
    assert len(losses) == 2 and losses == pytest.approx(plain, abs=1e-6)


@pytest.mark.parametrize("keep", [False, True])
def test_keep_attention_runs_each_attention_kernel_once(keep):
    """memory.keep_attention: the recompute takes the attention kernels' outputs from the forward (torch's
    selective checkpointing) instead of running them again; gradients bitwise those of plain checkpointing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is op
            return func(*args, **(kwargs or {}))

    mesh = seqpar.init_mesh(1)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    grads = {}
    for k in (False, keep):
        m = _model("llama", 0, False, mesh, {"ckpt": True, "keep": k})
        Count.n = 0
        with Count():
            m(input_ids=ids, position_ids=torch.arange(40)[None]).logits.float().pow(2).mean().backward()
        grads[k] = (_full_grads(m), Count.n)
    layers = len(m.model.layers)
    assert grads[keep][1] == (1 if keep else 2) * layers  # forward (+ recompute without keep_attention)
    assert _max_diff(grads[keep][0], grads[False][0]) == 0.0


def test_trainer_dropin_keep_attention_reaches_the_checkpoint(tmp_path):
    """The Trainer enables checkpointing itself in train(): the drop-in's wrapper adds the selective-checkpoint
    contexts that keep attention's outputs to the kwargs it passes."""
    from transformers import TrainingArguments

    from seqpar.hf.trainer import SequenceParallelTrainer
    from seqpar.memory.checkpointing import keep_attention_context

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_checkpointing=True)
    t = SequenceParallelTrainer(model=tiny_model("llama", *HEADS, vocab_size=VOCAB), args=args, keep_attention=True)
    t.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(args.gradient_checkpointing_kwargs))
    funcs = [m._gradient_checkpointing_func for m in t.model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert funcs and all(f.keywords.get("context_fn") is keep_attention_context for f in funcs)
    assert "context_fn" not in args.gradient_checkpointing_kwargs  # the TrainingArguments stay serialisable
