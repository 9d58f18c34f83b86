"""The hybrid families of issue 58 through whole HF models (tiny, random init, fp32) under ring 2, Ulysses 2 and
USP 2 x 2, against the unmodified model on every document alone (seqpar.hf.equivalence.compare: loss, every
real-token logit and every parameter gradient within 1e-5), padded rows (B = 2) and packed rows (documents of 41
and 23 tokens: boundaries inside shards; the recurrences' chunks are shorter than the documents).

- LFM2 (`Lfm2ShortConv`: short causal convolutions, kernel 3 with bias, no recurrence: a halo only), LFM2-MoE and
  LFM3 (the same layer; LFM3 with a sliding-window layer of 5 tokens);
- Falcon-H1 (Mamba2 beside attention, muP multipliers; with and without its gated norm), Zamba2 (Mamba2 + a shared
  attention block with LoRA adapters, used by two layers): the Mamba2 path;
- Jamba (Mamba1 + attention, MoE), Falcon-Mamba and Mamba (Mamba1 only): the selective scan (recurrent.selective);
- OLMo-hybrid (Gated DeltaNet), Kimi-Linear (KDA + MLA, MoE), MiniMax (lightning attention, blocks of 16, MoE);
- RecurrentGemma (RG-LRU blocks: a conv of kernel 4 and a diagonal recurrence that resets where position_ids are 0;
  local attention with a 16-token window and partial rotary);
plus float64 runs (recurrences swapped for tests/recurrent_ref.py's loops) and spies on the kernel functions.
The models are built once, in the main thread (fixed seed), and deep-copied in each rank's thread.
"""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
import transformers as tf
from hf_grid import assert_within, mixer_world, run_grid, summed_grad_errors
from recurrent_ref import patched_float64_kernels

import seqpar
from seqpar.errors import SeqParError
from seqpar.hf import apply_sequence_parallel, tiny_model
from seqpar.hf.recurrent_layers import find_recurrent, recurrent_forward
from seqpar.mesh import SequenceParallelMesh
from seqpar.threaded import run_threaded

TOL = 1e-5
ROWS = [[{"input_ids": [(7 * i) % 150 + 3 for i in range(41)]}, {"input_ids": [5, 9, 2, 7] * 5 + [11, 12, 13]}]]


def _run(models, modes):
    return run_grid(models, modes, ROWS)


def _check(results):
    worst = assert_within(results, TOL)
    print(f"worst errors: {worst}")  # pytest -s


IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
SMALL = {"vocab_size": 160, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, **IDS}


def _built(cfg):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).float()


def _families() -> dict:
    """name -> a function building the tiny model (tiny_model's archs, or a config here)."""
    return {
        "lfm2": lambda: tiny_model("lfm2"),
        "falcon_h1": lambda: tiny_model("falcon_h1"),
        "falcon_h1_nonorm": lambda: tiny_model("falcon_h1", mamba_rms_norm=False, mamba_n_groups=1),
        "zamba2": lambda: tiny_model("zamba2", num_layers=4),  # two hybrid layers share one attention block
        "jamba": lambda: tiny_model("jamba"),
        "falcon_mamba": lambda: tiny_model("falcon_mamba"),
        "mamba": lambda: tiny_model("mamba"),
        "olmo_hybrid": lambda: tiny_model("olmo_hybrid"),
        "kimi_linear": lambda: tiny_model("kimi_linear"),
        "minimax": lambda: tiny_model("minimax"),
        "recurrent_gemma": lambda: tiny_model("recurrent_gemma"),
        "lfm2_moe": lambda: _built(tf.Lfm2MoeConfig(**SMALL, moe_intermediate_size=16, num_hidden_layers=2,
                                                    conv_bias=True, num_dense_layers=1, num_experts=4,
                                                    num_experts_per_tok=2, layer_types=["conv", "full_attention"])),
        "lfm3": lambda: _built(tf.Lfm3Config(**SMALL, num_hidden_layers=3, sliding_window=5,
                                             layer_types=["conv", "sliding_attention", "full_attention"])),
    }


@pytest.fixture(scope="module")
def models():
    return {name: build() for name, build in _families().items()}


def test_families_ring2_ulysses2(models):
    _check(run_threaded(_run, 2, models, [(1, 2), (2, 1)], timeout=600))


def test_families_usp_2x2(models):
    _check(run_threaded(_run, 4, models, [(2, 2)], timeout=600))


F64_TOL = 1e-9
# Jamba: 1e-7. Its RMS norms (dt / B / C, layers) and its router's softmax compute in fp32 even in a float64 model,
# and x_proj's all-reduce (Ulysses) or the state correction (ring) changes their inputs in the 16th digit: 1-ulp
# fp32 flips, ~1e-8. The mixer alone in float64 is exact to 1e-15 (test_mixers_float64).
# Kimi-Linear: 1e-6. Its gated output norm computes in fp32 (and casts its weight to fp32) even in a float64 model;
# the mixer alone is exact to 1e-13 but for the fp32-cast parameters (test_mixers_float64).
# RecurrentGemma: 1e-8. Its RMS norms compute in fp32 (x.float()) even in a float64 model: gradients ~2.6e-9 (logits
# 2e-16); with the norms in float64 the whole model is exact to 1e-15, and the block alone to 1e-16
# (test_rg_lru_float64_packed).
F64_FAMILIES = {"lfm2": ({}, F64_TOL), "olmo_hybrid": ({}, F64_TOL), "kimi_linear": ({}, 1e-6),
                "falcon_h1": ({}, F64_TOL), "zamba2": ({"num_layers": 4}, F64_TOL), "jamba": ({}, 1e-7),
                "minimax": ({}, F64_TOL), "recurrent_gemma": ({}, 1e-8)}


@pytest.mark.slow
def test_families_float64_ring2_ulysses2():
    """In float64, with the recurrences swapped for the token-by-token loops of tests/recurrent_ref.py (transformers'
    torch scan computes in fp32): SP equals the unsharded model to ~1e-11 (gradients ~0.1-1). fp32's 1e-5 above is
    rounding only; what it hides in a long run (Adam on Zamba2's ~1e-9 A_log gradients) is not SP's."""
    f64 = {name: tiny_model(name, dtype=torch.float64, **kw) for name, (kw, _) in F64_FAMILIES.items()}
    with patched_float64_kernels(*{type(m).__module__ for m in f64.values()}):
        results = run_threaded(_run, 2, f64, [(1, 2), (2, 1)], timeout=600)
    bad = [(k, e) for rank in results for k, e in rank
           if max(e["loss"], e["grad"], e["logits"]) > F64_FAMILIES[k[0]][1]]
    assert not bad, bad


# arch: the parameters upstream's forward casts to fp32 (`.float()`, `.to(torch.float32)`) even in a float64 model
FP32_CAST = {"jamba": ("A_log", "D", "dt_proj.bias"), "kimi_linear": ("forget_gate.dt_bias", "forget_gate.A_log",
                                                                       "o_norm.weight")}


@pytest.mark.parametrize("arch", sorted(FP32_CAST))
def test_mixers_float64(monkeypatch, arch):
    """One mixer in float64 (its recurrence swapped for tests/recurrent_ref.py's loop; Jamba's RMS norms computed in
    float64) under Ulysses 2 and ring 2: output to 1e-14, every gradient to 1e-12 relative but those of the
    parameters upstream casts to fp32 in the forward: their gradients are fp32-rounded, and SP sums the piece's and
    the correction's shares before that rounding, upstream only one (2e-7)."""
    import transformers.models.jamba.modeling_jamba as jamba

    def norm64(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(jamba.JambaRMSNorm, "forward", norm64)
    model = tiny_model(arch, dtype=torch.float64)
    with patched_float64_kernels(type(model).__module__):
        for u, r in ((2, 1), (1, 2)):
            for out_err, errs in run_threaded(mixer_world, 2, model, u, r, timeout=120):
                assert out_err < 1e-14, (u, r, out_err)
                assert all(e < (2e-7 if n in FP32_CAST[arch] else 1e-12) for n, e in errs.items()), (u, r, errs)


def _rg_world(model, u: int, r: int):
    """RecurrentGemma's recurrent block in SP (float64, B = 2 rows of 40 tokens: row 0 packed, documents of 17 and
    23 tokens whose position_ids restart; row 1 one document) vs upstream's block on every document alone: output
    error and, per parameter, the gradient's max relative error (summed over the ranks)."""
    mesh = seqpar.init_mesh(2, ulysses_degree=u, ring_degree=r)
    layer = copy.deepcopy(find_recurrent(model)[0][0])
    ref_layer = copy.deepcopy(layer)
    x, w = (torch.randn(2, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(i),
                        dtype=torch.float64) for i in (0, 1))
    pos = torch.stack([torch.cat([torch.arange(17), torch.arange(23)]), torch.arange(40)])
    docs = [((0, 17), (17, 40)), ((0, 40),)]
    ref = torch.cat([torch.cat([ref_layer(x[i:i + 1, a:b], position_ids=pos[i:i + 1, a:b], attention_mask=None,
                                          use_cache=False)[0] for a, b in docs[i]], dim=1) for i in range(2)])
    (ref * w).sum().backward()
    out, _ = recurrent_forward(layer)(layer, seqpar.shard(x, mesh, 1), None, ((17,), ()), mesh,
                                      position_ids=seqpar.shard(pos, mesh, 1))
    (out * seqpar.shard(w, mesh, 1)).sum().backward()
    return float((seqpar.unshard(out.detach(), mesh, 1) - ref.detach()).abs().max()), \
        summed_grad_errors(ref_layer, layer)


def test_rg_lru_float64_packed():
    """RecurrentGemma's block in float64 (its scan swapped for tests/recurrent_ref.py's loop) under Ulysses 2 and
    ring 2, a packed row among the two: the reset at each document's position 0, the conv's and the state's restart
    and the state passed between ring ranks: output to 1e-14, every gradient to 1e-13 relative (measured 1e-16,
    6e-16)."""
    model = tiny_model("recurrent_gemma", dtype=torch.float64)
    with patched_float64_kernels(type(model).__module__):
        for u, r in ((2, 1), (1, 2)):
            for out_err, errs in run_threaded(_rg_world, 2, model, u, r, timeout=120):
                assert out_err < 1e-14, (u, r, out_err)
                assert all(e < 1e-13 for e in errs.values()), (u, r, errs)


def test_rg_lru_ulysses_degree_refused():
    """Ulysses must split the RG-LRU's gate blocks (one per head): 3 heads under Ulysses 2 are refused at apply time,
    by name (the ring takes any head count)."""
    model = tiny_model("recurrent_gemma", num_heads=3, num_kv_heads=1)
    with pytest.raises(SeqParError, match="RG-LRU gate blocks"):
        apply_sequence_parallel(model, SequenceParallelMesh(dp_size=1, ring_degree=1, ulysses_degree=2,
                                                            layout="zigzag"))
    apply_sequence_parallel(model, SequenceParallelMesh(dp_size=1, ring_degree=2, ulysses_degree=1, layout="zigzag"))


@pytest.mark.parametrize("arch", sorted(_families()))
def test_every_mixer_gets_the_sp_forward(models, arch):
    """The comparisons above would pass vacuously if a family's mixers kept their own forward: they do not."""
    model = copy.deepcopy(models[arch])
    layers, _ = find_recurrent(model)
    assert layers
    apply_sequence_parallel(model, SequenceParallelMesh(dp_size=1, ring_degree=2, ulysses_degree=2, layout="zigzag"))
    assert all("forward" in m.__dict__ for m in layers)
    assert torch.is_grad_enabled()


class Spy:
    """Stands in for a kernel function of the model's module: counts calls, delegates to the real one."""

    def __init__(self, inner):
        self.inner, self.calls, self.lock = inner, 0, threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.calls += 1
        return self.inner(*args, **kwargs)


# arch: the module functions its mixer's forward calls (where transformers dispatches to causal-conv1d / mamba_ssm /
# flash-linear-attention when installed); MiniMax's lightning attention calls none (its block algorithm is inline),
# nor does RecurrentGemma (its scan is the layer's `_rnn_scan`, a torch loop: test_rg_lru_float64_packed swaps it for
# a float64 loop, which the SP forward must call to pass)
_M1 = ("causal_conv1d_fn", "mamba_selective_scan")
KERNELS = {"lfm2": ("causal_conv1d_fn",), "falcon_h1": ("causal_conv1d_fn", "mamba2_chunk_scan"),
           "zamba2": ("causal_conv1d_fn", "mamba2_chunk_scan"), "jamba": _M1, "falcon_mamba": _M1, "mamba": _M1,
           "olmo_hybrid": ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"),
           "kimi_linear": ("causal_conv1d_fn", "chunk_kimi_delta_attention")}


def _layer_world(model):
    """One mixer's SP forward at ring 2 (pieces carry history) vs its own forward on the whole sequence."""
    mesh = seqpar.init_mesh(2, ulysses_degree=1, ring_degree=2)
    layer = copy.deepcopy(find_recurrent(model)[0][0])
    x = torch.randn(1, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ref = layer(x)
    out = recurrent_forward(layer)(layer, seqpar.shard(x, mesh, 1), None, ((),), mesh)
    return float((seqpar.unshard(out.detach(), mesh, 1) - ref.detach()).abs().max())


@pytest.mark.parametrize("arch", sorted(KERNELS))
def test_sp_forward_calls_the_module_kernels(monkeypatch, models, arch):
    """On GPUs transformers routes these functions to the installed kernels: the SP forward calls the same ones."""
    model = models[arch]
    module = sys.modules[type(find_recurrent(model)[0][0]).__module__]
    spies = {name: Spy(getattr(module, name)) for name in KERNELS[arch]}
    for name, spy in spies.items():
        monkeypatch.setattr(module, name, spy)
    errs = run_threaded(_layer_world, 2, model, timeout=120)
    assert max(errs) < 2e-5, errs
    assert all(s.calls for s in spies.values()), {n: s.calls for n, s in spies.items()}
