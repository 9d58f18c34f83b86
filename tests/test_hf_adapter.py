"""seqpar.hf.apply_sequence_parallel: scoping, refusals, kwargs plumbing, eval mode, checkpointing, PEFT LoRA.

In-process tests use a world-1 mesh (seqpar attention still runs, packing still matters); one
spawned 2-rank world (ring=2, zigzag) covers LoRA, eval mode, gradient checkpointing, a model that
drops unknown kwargs, and a refusal raised on every rank. References are the plain HF model run
per document, unpadded. Tolerance: fp32, 1e-5 absolute (logits 2e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar import SeqParError
from seqpar.hf import apply_sequence_parallel, is_sequence_parallel, remove_sequence_parallel, tiny_model
from seqpar.spawn import run_distributed

TOL = 1e-5
LOGIT_TOL = 2e-5


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ids(n, b=1, seed=0):
    return torch.randint(3, 160, (b, n), generator=torch.Generator().manual_seed(seed))


def _pos(n, b=1):
    return torch.arange(n)[None].expand(b, n)


def _docs_reference(model, ids, bounds):
    """Logits of a packed row computed document by document (independent of any packing logic)."""
    cuts = [0, *bounds, ids.shape[1]]
    outs = [
        model(input_ids=ids[:, a:b], position_ids=torch.arange(b - a)[None]).logits for a, b in zip(cuts, cuts[1:])
    ]
    return torch.cat(outs, dim=1)


# ----------------------------------------------------------------------------- scoping
def test_scoped_to_one_model_and_removable():
    from transformers import AttentionInterface

    mesh = seqpar.init_mesh(1)
    a, b = tiny_model("llama", 4, 2), tiny_model("llama", 4, 2)
    # Models built from one config object share it: seqpar must not switch the other model.
    shared_cfg = tiny_model("llama", 4, 2).config
    from transformers import LlamaForCausalLM

    c1, c2 = LlamaForCausalLM(shared_cfg), LlamaForCausalLM(shared_cfg)
    apply_sequence_parallel(a, mesh)
    apply_sequence_parallel(c1, mesh)
    name = a.config._attn_implementation
    assert name.startswith("seqpar_sp_") and name in AttentionInterface._global_mapping
    assert c1.config._attn_implementation not in (name, "sdpa")  # unique per call
    assert b.config._attn_implementation == "sdpa"
    assert c2.config._attn_implementation == "sdpa" and c2.config is shared_cfg
    assert all(m.config is a.config for m in a.modules() if hasattr(m, "config"))
    assert is_sequence_parallel(a) and not is_sequence_parallel(b)
    ids = _ids(24)
    with pytest.raises(SeqParError, match="already applied"):
        apply_sequence_parallel(a, mesh)
    with pytest.raises(SeqParError, match="deep-copy"):
        copy.deepcopy(a)
    want = b(input_ids=ids, position_ids=_pos(24)).logits
    got = a(input_ids=ids, position_ids=_pos(24)).logits
    assert (got - want).abs().max() <= LOGIT_TOL
    remove_sequence_parallel(a)
    assert a.config._attn_implementation == "sdpa" and not is_sequence_parallel(a)
    assert name not in AttentionInterface._global_mapping
    # Back to plain HF: no position_ids needed any more.
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    # A garbage-collected SP model takes its registration with it.
    import gc

    other = c1.config._attn_implementation
    del c1
    gc.collect()
    assert other not in AttentionInterface._global_mapping


def test_eval_mode_and_no_grad_run_under_sp():
    mesh = seqpar.init_mesh(1)
    ref = tiny_model("qwen3", 9, 3).eval()
    m = apply_sequence_parallel(tiny_model("qwen3", 9, 3), mesh).eval()
    ids = _ids(30, b=2)
    with torch.no_grad():
        got = m(input_ids=ids, position_ids=_pos(30, 2)).logits
        want = ref(input_ids=ids, position_ids=_pos(30, 2)).logits
    assert m._seqpar_state.kwarg_seen, "eval forward did not go through seqpar attention"
    assert (got - want).abs().max() <= LOGIT_TOL


def test_trainers_exported_lazily():
    import seqpar.hf as hf

    assert hf.SequenceParallelTrainer.__name__ == "SequenceParallelTrainer"
    assert hf.SequenceParallelDPOTrainer.__name__ == "SequenceParallelDPOTrainer"


# ----------------------------------------------------------------------------- packing plumbing
def test_cu_seqlens_reach_attention():
    """Explicit cu_seqlens with positions that do NOT restart: only cu_seqlens can separate the docs."""
    mesh = seqpar.init_mesh(1)
    ref = tiny_model("llama", 4, 2)
    m = apply_sequence_parallel(tiny_model("llama", 4, 2), mesh)
    ids = _ids(32)
    got = m(input_ids=ids, position_ids=_pos(32), cu_seqlens=torch.tensor([0, 10, 32], dtype=torch.int32)).logits
    cont = ref(input_ids=ids, position_ids=_pos(32)).logits
    # Reference: doc 2 sees only itself but keeps its (continuing) positions.
    doc2 = ref(input_ids=ids[:, 10:], position_ids=torch.arange(10, 32)[None]).logits
    assert (got[:, :10] - cont[:, :10]).abs().max() <= LOGIT_TOL
    assert (got[:, 10:] - doc2).abs().max() <= LOGIT_TOL
    assert (got[:, 10:] - cont[:, 10:]).abs().max() > 1e-3  # the boundary really changed something
    assert m._seqpar_state.kwarg_seen


def test_packed_rows_from_position_ids_with_batch():
    """B=2, each row packed (positions restart), no cu_seqlens: derived per row, like HF does."""
    mesh = seqpar.init_mesh(1)
    ref = tiny_model("mistral", 9, 3)
    m = apply_sequence_parallel(tiny_model("mistral", 9, 3), mesh)
    ids = _ids(24, b=2)
    pos = torch.stack([torch.cat([torch.arange(9), torch.arange(15)]), torch.arange(24)])
    got = m(input_ids=ids, position_ids=pos).logits
    assert (got[:1] - _docs_reference(ref, ids[:1], [9])).abs().max() <= LOGIT_TOL
    assert (got[1:] - ref(input_ids=ids[1:], position_ids=pos[1:]).logits).abs().max() <= LOGIT_TOL


def test_gradient_checkpointing_keeps_packing():
    mesh = seqpar.init_mesh(1)
    ref = tiny_model("llama", 4, 2)
    m = apply_sequence_parallel(tiny_model("llama", 4, 2), mesh)
    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    ids = _ids(20)
    pos = torch.cat([torch.arange(8), torch.arange(12)])[None]
    m(input_ids=ids, position_ids=pos).logits.square().mean().backward()
    _docs_reference(ref, ids, [8]).square().mean().backward()
    err = max(float((p.grad - q.grad).abs().max()) for p, q in zip(m.parameters(), ref.parameters()))
    assert err <= TOL


# ----------------------------------------------------------------------------- refusals
def test_refusals_at_apply():
    mesh = seqpar.init_mesh(1)
    with pytest.raises(SeqParError, match="softcapping"):
        apply_sequence_parallel(tiny_model("gemma2", 4, 2, attn_logit_softcapping=50.0), mesh)
    m = apply_sequence_parallel(tiny_model("llama", 4, 2, attention_dropout=0.1), mesh)
    ids = _ids(16)
    with pytest.raises(SeqParError, match="dropout=0.1 \\(train mode\\)"):
        m.train()(input_ids=ids, position_ids=_pos(16))
    m.eval()(input_ids=ids, position_ids=_pos(16))  # HF passes dropout=0 in eval mode
    with pytest.raises(SeqParError, match="SequenceParallelMesh"):
        apply_sequence_parallel(tiny_model("llama", 4, 2), None)


_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
_MAMBA2_MIX = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4)
# (family, config class, model class, tiny config kwargs, what the refusal must name)
# (Gated DeltaNet, KDA, Mamba2, Mamba1, lightning attention, the RG-LRU and LFM2's short convs are supported:
# tests/test_hf_hybrid*.py; the models built from the configs of test_supported_recurrent_hybrids pass.)
NON_ATTENTION_MODELS = [
    ("mamba2", "Mamba2Config", "Mamba2ForCausalLM",
     dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, num_heads=4, head_dim=16,
          n_groups=1), "Mamba2Mixer"),
    ("rwkv", "RwkvConfig", "RwkvForCausalLM",
     dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64),
     "RwkvForCausalLM: a Rwkv model"),
    ("xlstm", "xLSTMConfig", "xLSTMForCausalLM", dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4),
     "xLSTMForCausalLM: a xLSTM model"),
]


@pytest.mark.parametrize("family,cfg_cls,model_cls,kw,named", NON_ATTENTION_MODELS,
                         ids=[m[0] for m in NON_ATTENTION_MODELS])
def test_refuses_non_softmax_sequence_mixers(family, cfg_cls, model_cls, kw, named):
    """Linear attention, SSMs, convolutions, recurrences, chunked attention: refused at apply time, by name."""
    import transformers  # every family here is in transformers 5.x (pyproject's range): a missing one fails

    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
    with pytest.raises(SeqParError, match="outside softmax attention") as e:
        apply_sequence_parallel(model, seqpar.init_mesh(1))
    assert named in str(e.value) and "softmax-attention models only" in str(e.value), str(e.value)
    assert not is_sequence_parallel(model)


SUPPORTED_RECURRENT = [
    ("BambaConfig", "BambaForCausalLM", dict(_SMALL, attn_layer_indices=[1], **_MAMBA2_MIX)),
    ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
     dict(_SMALL, num_local_experts=2, num_experts_per_tok=1, layer_types=["mamba", "attention"], **_MAMBA2_MIX)),
    ("MambaConfig", "MambaForCausalLM",
     dict(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4)),
    ("JambaConfig", "JambaForCausalLM",
     dict(_SMALL, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
          expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
          mamba_dt_rank=4)),
    ("FalconH1Config", "FalconH1ForCausalLM",
     dict(_SMALL, head_dim=8, mamba_d_ssm=64, **_MAMBA2_MIX)),
    ("Zamba2Config", "Zamba2ForCausalLM",
     dict(_SMALL, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=4, mamba_ngroups=1, num_mem_blocks=1,
          layers_block_type=["mamba", "hybrid"])),
    ("Lfm2Config", "Lfm2ForCausalLM", dict(_SMALL, layer_types=["conv", "full_attention"])),
    ("MiniMaxConfig", "MiniMaxForCausalLM", dict(_SMALL, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                                                 layer_types=["linear_attention", "full_attention"])),
    ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
     dict(_SMALL, lru_width=32, attention_window_size=16, conv1d_width=4, num_hidden_layers=3)),
]


@pytest.mark.parametrize("cfg_cls,model_cls,kw", SUPPORTED_RECURRENT,
                         ids=["bamba", "granite_moe_hybrid", "mamba", "jamba", "falcon_h1", "zamba2", "lfm2",
                              "minimax", "recurrent_gemma"])
def test_supported_recurrent_hybrids(cfg_cls, model_cls, kw):
    """Bamba and Granite 4 (legacy "mamba" layer names included), Mamba, Jamba, Falcon-H1, Zamba2, LFM2, MiniMax,
    RecurrentGemma: their recurrent / conv mixers get seqpar's forward, and at SP=1 it gives the model's own logits
    (fp32, 1e-5); other mixers stay refused (the list above)."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    ids = _ids(40, b=1) % 64  # the configs' vocabulary
    want = model(input_ids=ids).logits
    apply_sequence_parallel(model, seqpar.init_mesh(1))
    assert any("forward" in m.__dict__ for m in model.modules())
    got = model(input_ids=ids, position_ids=_pos(40, 1)).logits
    assert float((got - want).abs().max()) <= 1e-5


def test_mixer_detection_by_structure_and_config():
    """Signals that do not depend on a known class name: a plain Conv1d along the sequence, layer_types."""
    from seqpar.hf.mixers import find_sequence_mixers

    m = tiny_model("llama", 4, 2)
    cfg = m.config
    m.model.layers[0].add_module("token_conv", torch.nn.Conv1d(32, 32, kernel_size=3, padding=2, groups=32))
    assert any("model.layers.0.token_conv: Conv1d with kernel size 3" in f for f in find_sequence_mixers(m, cfg))
    m = tiny_model("llama", 4, 2)
    m.model.layers[0].add_module("pointwise", torch.nn.Conv1d(32, 32, kernel_size=1))  # per token: fine
    assert find_sequence_mixers(m, cfg) == []
    cfg.layer_types = ["full_attention", "my_linear_attention"]
    want = "config.layer_types has non-softmax-attention layers ['my_linear_attention']"
    assert find_sequence_mixers(m, cfg) == [want]


@pytest.mark.parametrize("arch", seqpar.hf.ARCHS)
def test_supported_archs_have_no_sequence_mixers(arch):
    from seqpar.hf.mixers import find_sequence_mixers

    m = tiny_model(arch, 4, 2)
    assert find_sequence_mixers(m, m.config) == []
    assert is_sequence_parallel(apply_sequence_parallel(m, seqpar.init_mesh(1)))


def test_refusals_at_forward():
    mesh = seqpar.init_mesh(1)
    ids = _ids(24, b=2)
    m = apply_sequence_parallel(tiny_model("llama", 4, 2, attention_dropout=0.1), mesh)
    with pytest.raises(SeqParError, match="attention dropout=0.1"):
        m.train()(input_ids=ids, position_ids=_pos(24, 2))
    m.eval()(input_ids=ids, position_ids=_pos(24, 2))  # no dropout in eval mode: exact, allowed
    m = apply_sequence_parallel(tiny_model("llama", 4, 2), mesh)
    with pytest.raises(SeqParError, match="position_ids are required"):
        m(input_ids=ids)
    with pytest.raises(SeqParError, match="labels="):
        m(input_ids=ids, position_ids=_pos(24, 2), labels=ids)
    left = torch.ones(2, 24, dtype=torch.long)
    left[0, :3] = 0
    with pytest.raises(SeqParError, match="not right-padded"):
        m(input_ids=ids, position_ids=_pos(24, 2), attention_mask=left)
    right = torch.ones(2, 24, dtype=torch.long)
    right[0, -3:] = 0
    m(input_ids=ids, position_ids=_pos(24, 2), attention_mask=right)  # right padding is harmless
    filled = tiny_model("llama", 4, 2)(input_ids=ids, use_cache=True).past_key_values
    for name in ("cache", "past_key_values"):  # transformers >= 5.24 / before (the newer one accepts both)
        with pytest.raises(SeqParError, match="filled KV cache"):
            m(input_ids=ids, position_ids=_pos(24, 2), **{name: filled})
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with pytest.raises(SeqParError, match="cu_seqlens and position_ids disagree"):
        m(input_ids=ids[:1], position_ids=pos, cu_seqlens=torch.tensor([0, 24]))
    with pytest.raises(SeqParError, match="FULL"):
        m(input_ids=ids[:1], position_ids=_pos(24), cu_seqlens=torch.tensor([0, 20]))
    m.model.layers[0].self_attn.is_causal = False
    with pytest.raises(SeqParError, match="not causal"):
        m(input_ids=ids, position_ids=_pos(24, 2))
    m.model.layers[0].self_attn.is_causal = True
    m.model.layers[0].self_attn.attention_dropout = 0.2
    m.train()
    with pytest.raises(SeqParError, match="dropout"):
        m(input_ids=ids, position_ids=_pos(24, 2))
    m.eval()
    m(input_ids=ids, position_ids=_pos(24, 2))  # no dropout in eval mode


# ----------------------------------------------------------------------------- spawned: SP=2 ring
def _drop_unknown_kwargs(layer):
    """Simulate a model whose decoder layers do not forward unknown kwargs."""
    orig = layer.forward

    def forward(*args, **kwargs):
        kwargs.pop("seqpar_plan", None)
        kwargs.pop("cu_seqlens", None)
        return orig(*args, **kwargs)

    layer.forward = forward


def _lora(model):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    torch.manual_seed(1)
    peft = get_peft_model(model, cfg)
    with torch.no_grad():  # lora_B starts at 0: give it values so every LoRA grad is non-trivial
        for i, (n, p) in enumerate(peft.named_parameters()):
            if "lora_B" in n:  # same values on every rank (no str hash: it is randomised per process)
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
    return peft


def _sft_reference(model, ids, pos_full, labels_full, bounds):
    logits = _docs_reference(model, ids, bounds) if bounds else model(input_ids=ids, position_ids=pos_full).logits
    return F.cross_entropy(logits[0].double(), labels_full[0], ignore_index=-100, reduction="mean"), logits


def spawned_checks():
    from seqpar import loss as L

    torch.manual_seed(0)
    mesh = seqpar.init_mesh(2, ring_degree=2)
    out = {}
    n, bnd = 48, [20]
    ids = _ids(n, seed=3)
    pos = torch.cat([torch.arange(20), torch.arange(28)])[None]
    # full-sequence shifted targets, nothing across the document boundary
    tgt = torch.full((1, n), -100)
    tgt[0, :-1] = ids[0, 1:]
    tgt[0, 19] = -100
    cnt = int((tgt != -100).sum())
    shard = lambda t: seqpar.shard(t, mesh, 1)  # noqa: E731

    # 1. PEFT LoRA (applied after get_peft_model), train mode: loss and LoRA grads
    ref = _lora(tiny_model("llama", 9, 3))
    sp = apply_sequence_parallel(_lora(tiny_model("llama", 9, 3)), mesh)
    want, _ = _sft_reference(ref, ids, pos, tgt, bnd)
    want.backward()
    logits = sp(input_ids=shard(ids), position_ids=shard(pos)).logits
    share = L.sft_loss(logits, shard(tgt), cnt)
    share.backward()
    L.sum_gradients([p for p in sp.parameters() if p.requires_grad], mesh)
    lora = [(a, b) for (na, a), (_, b) in zip(ref.named_parameters(), sp.named_parameters()) if "lora_" in na]
    assert len(lora) == 16 and all(b.grad is not None for _, b in lora)
    frozen_have_grad = any(p.grad is not None for n_, p in sp.named_parameters() if "lora_" not in n_)
    out["lora_loss"] = abs(float(L.global_loss(share, mesh)) - float(want.detach()))
    out["lora_grad"] = max(float((a.grad - b.grad).abs().max()) for a, b in lora)
    out["lora_frozen_grad"] = frozen_have_grad

    # 2. eval mode, no grad, model that drops unknown kwargs (plan falls back to per-model state)
    ref = tiny_model("phi3", 9, 3).eval()
    sp = apply_sequence_parallel(tiny_model("phi3", 9, 3), mesh).eval()
    for layer in sp.model.layers:
        _drop_unknown_kwargs(layer)
    with torch.no_grad():
        got = seqpar.unshard(sp(input_ids=shard(ids), position_ids=shard(pos)).logits, mesh, 1)
        want_logits = _docs_reference(ref, ids, bnd)
    out["dropkw_logits"] = float((got - want_logits).abs().max())
    out["dropkw_used_state"] = not sp._seqpar_state.kwarg_seen

    # 3. gradient checkpointing under SP (recompute must see the same plan)
    ref = tiny_model("gemma3", 4, 2)
    sp = apply_sequence_parallel(tiny_model("gemma3", 4, 2), mesh)
    sp.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    sp.train()
    want, _ = _sft_reference(ref, ids, pos, tgt, bnd)
    want.backward()
    share = L.sft_loss(sp(input_ids=shard(ids), position_ids=shard(pos)).logits, shard(tgt), cnt)
    share.backward()
    L.sum_gradients(sp.parameters(), mesh)
    out["ckpt_grad"] = max(float((a.grad - b.grad).abs().max()) for a, b in zip(ref.parameters(), sp.parameters()))

    # 4. the equivalence harness (packed rows, awkward heads)
    from seqpar.hf.equivalence import compare

    g = torch.Generator().manual_seed(5)
    rows = [[{"input_ids": torch.randint(3, 160, (n,), generator=g)} for n in (13, 21, 9)]]
    out["harness"] = compare(lambda: tiny_model("qwen2", 14, 2), rows, mesh, packing=True)

    # 5. a refusal is raised on every rank (same decision everywhere, no hang)
    sp = apply_sequence_parallel(tiny_model("llama", 4, 2, attention_dropout=0.1), mesh).train()
    try:
        sp(input_ids=shard(ids), position_ids=shard(pos))
        out["refused"] = False
    except SeqParError:
        out["refused"] = True

    # 6. per-shard position_ids (arange(S_local) on every rank) are refused; genuine seam-aligned packing is not
    out.update(_local_positions_checks(mesh))
    return out


def _refusal(fn):
    try:
        fn()
    except SeqParError as e:
        return str(e)
    return None


def _packed_sp_errors(mesh, model_fn, ids, pos_full, bounds, **kw):
    """Max |logits| and |grad| error of an SP forward/backward vs the plain model run per document."""
    from seqpar import loss as L

    ref, sp = model_fn(), apply_sequence_parallel(model_fn(), mesh)
    want = _docs_reference(ref, ids, bounds)
    want.square().mean().backward()
    logits = sp(input_ids=seqpar.shard(ids, mesh, 1), position_ids=seqpar.shard(pos_full, mesh, 1), **kw).logits
    (logits.square().sum() / want.numel()).backward()  # this rank's share of the mean
    L.sum_gradients(sp.parameters(), mesh)
    got = seqpar.unshard(logits.detach(), mesh, 1)
    grad = max(float((a.grad - b.grad).abs().max()) for a, b in zip(ref.parameters(), sp.parameters()))
    return float((got - want.detach()).abs().max()), grad


def _local_positions_checks(ring_mesh):
    out = {}
    contig = seqpar.init_mesh(2, ulysses_degree=2)  # contiguous layout: one seam at S/2
    model_fn = lambda: tiny_model("llama", 4, 2)  # noqa: E731
    ids = _ids(16, seed=7)
    m = apply_sequence_parallel(model_fn(), ring_mesh)
    local = torch.arange(8)[None]
    # zigzag ring 2, S=16: chunks of 4; local aranges would read as documents starting at 4 and 12
    out["local_zigzag"] = _refusal(lambda: m(input_ids=seqpar.shard(ids, ring_mesh, 1), position_ids=local))
    c = apply_sequence_parallel(model_fn(), contig)
    out["local_contig"] = _refusal(lambda: c(input_ids=seqpar.shard(ids, contig, 1), position_ids=local))
    # A genuine document starting exactly at a zigzag seam (8) with global positions: accepted and exact.
    two_docs = torch.cat([torch.arange(8), torch.arange(8)])[None]
    out["seam_doc_zigzag"] = _packed_sp_errors(ring_mesh, model_fn, ids, two_docs, [8])
    # Contiguous: the same packing IS arange(8) per rank: ambiguous, refused; cu_seqlens disambiguates.
    out["seam_doc_contig_nocu"] = _refusal(lambda: _packed_sp_errors(contig, model_fn, ids, two_docs, [8]))
    out["seam_doc_contig_cu"] = _packed_sp_errors(contig, model_fn, ids, two_docs, [8],
                                                  cu_seqlens=torch.tensor([0, 8, 16]))
    return out


def test_spawned_lora_eval_checkpointing_refusal():
    for r in run_distributed(spawned_checks, 2, timeout=240):
        assert r["lora_loss"] <= TOL and r["lora_grad"] <= TOL, r
        assert not r["lora_frozen_grad"], "frozen base weights got gradients"
        assert r["dropkw_logits"] <= LOGIT_TOL and r["dropkw_used_state"], r
        assert r["ckpt_grad"] <= TOL, r
        assert r["refused"], r
        assert "look per-shard" in r["local_zigzag"] and "[4, 12]" in r["local_zigzag"], r
        assert "seqpar.shard(full_position_ids" in r["local_zigzag"], r
        assert "look per-shard" in r["local_contig"] and "cu_seqlens=[0, 8, 16]" in r["local_contig"], r
        assert "look per-shard" in r["seam_doc_contig_nocu"], r
        for key in ("seam_doc_zigzag", "seam_doc_contig_cu"):
            logit_err, grad_err = r[key]
            assert logit_err <= LOGIT_TOL and grad_err <= TOL, (key, r[key])
        h = r["harness"]
        assert h["loss"] <= TOL and h["grad"] <= TOL and h["logits"] <= LOGIT_TOL and h["count"] == 0, h
