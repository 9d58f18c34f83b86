"""Hybrids' SP forward runs the conv / recurrence functions the unsharded layer runs (seqpar.hf.layer_kernels).

With flash-linear-attention, causal-conv1d or mamba_ssm installed, transformers routes a Gated DeltaNet / Mamba2
layer's conv and recurrence to their kernels; the SP forward must call those same functions, with the state-passing
inputs it needs (an initial state per Gated DeltaNet ring piece). On CPU a recording spy stands in for each kernel:
it must be called by the SP forward (ring 2, so pieces carry state), both where transformers binds it (the
module's dispatching function) and where earlier releases bind it (an attribute on the layer), and the SP output
still equals the layer's own forward on the whole sequence (fp32, 2e-5). The numbers of the real kernels: `make
test-gpu` (tests/test_gpu_sp.py) where the package is installed.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import seqpar
from seqpar.hf import tiny_model
from seqpar.hf.layer_kernels import kernel_origin, layer_function, torch_causal_conv1d
from seqpar.hf.linear_attention import find_linear_attention, sp_gated_delta_forward
from seqpar.hf.mamba2 import find_mamba2, sp_mamba2_forward
from seqpar.threaded import run_threaded, serial

CASES = {  # arch: (finder, SP forward, the recurrence's module function, its attribute on earlier layers, whether
    # ring pieces hand it an initial state: the delta rule does ([0 | I] for the state's transition), Mamba2's scan
    # runs from zero and is corrected in closed form: seqpar.recurrent.ssd)
    "qwen3_5": (find_linear_attention, sp_gated_delta_forward, "torch_chunk_gated_delta_rule", "chunk_gated_delta_rule",
                True),
    "nemotron_h": (find_mamba2, sp_mamba2_forward, "mamba2_chunk_scan", None, False),
}


class Spy:
    """Stands in for a kernel function: records whether each call got an initial state, delegates to `inner`."""

    def __init__(self, inner):
        self.inner, self.calls, self.lock = inner, [], threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.calls.append(kwargs.get("initial_state", kwargs.get("initial_states")) is not None)
        return self.inner(*args, **kwargs)


def _world(arch: str, on_layer: Spy | None):
    find, sp_forward, _, attr, _ = CASES[arch]
    mesh = seqpar.init_mesh(2, ulysses_degree=1, ring_degree=2)
    with serial():
        layer = find(tiny_model(arch, num_layers=2))[0]
    x = torch.randn(1, 96, layer.hidden_size if hasattr(layer, "hidden_size") else layer.in_proj.in_features,
                    generator=torch.Generator().manual_seed(0))
    ref = layer(x)[0] if isinstance(layer(x), tuple) else layer(x)
    if on_layer is not None:
        setattr(layer, attr, on_layer)  # as earlier transformers releases bind the kernel
    out = sp_forward(layer, seqpar.shard(x, mesh, 1), None, ((),), mesh)
    return float((seqpar.unshard(out.detach(), mesh, 1) - ref.detach()).abs().max())


@pytest.mark.parametrize("arch", sorted(CASES))
def test_sp_forward_calls_the_module_kernels(monkeypatch, arch):
    module = sys.modules[type(CASES[arch][0](tiny_model(arch, num_layers=2))[0]).__module__]
    rule, conv = Spy(getattr(module, CASES[arch][2])), Spy(module.causal_conv1d_fn)
    monkeypatch.setattr(module, CASES[arch][2], rule)
    monkeypatch.setattr(module, "causal_conv1d_fn", conv)
    errs = run_threaded(_world, 2, arch, None, timeout=120)
    assert max(errs) < 2e-5, errs
    assert rule.calls and conv.calls, "the SP forward did not run the module's kernels"
    assert any(rule.calls) == CASES[arch][4], "initial states not as the state passing hands them"


def test_sp_forward_calls_a_kernel_bound_to_the_layer():
    rule = Spy(layer_function(find_linear_attention(tiny_model("qwen3_5", num_layers=2))[0],
                              "torch_chunk_gated_delta_rule"))
    errs = run_threaded(_world, 2, "qwen3_5", rule, timeout=120)
    assert max(errs) < 2e-5, errs
    assert any(rule.calls), "the kernel bound to the layer was not called"


def test_conv_fallback_and_missing_functions(monkeypatch):
    layer = find_linear_attention(tiny_model("qwen3_5", num_layers=2))[0]
    module = sys.modules[type(layer).__module__]
    x = torch.randn(2, layer.conv_dim, 11)
    w, b = layer.conv1d.weight.squeeze(1), torch.randn(layer.conv_dim)
    torch.testing.assert_close(torch_causal_conv1d(x, w, b, "silu"), module.causal_conv1d_fn(x, w, b, "silu"))
    # transformers' dispatching wrapper runs the implementation it chose at import: here its torch fallback
    assert kernel_origin(layer_function(layer, "torch_chunk_gated_delta_rule")) == module.__name__
    assert kernel_origin(torch_causal_conv1d) == "seqpar.hf.layer_kernels"
    layer.causal_conv1d_fn = None  # an earlier release without causal-conv1d: the module's, else torch's
    assert layer_function(layer, "causal_conv1d_fn") is module.causal_conv1d_fn
    monkeypatch.delattr(module, "causal_conv1d_fn")
    assert layer_function(layer, "causal_conv1d_fn") is torch_causal_conv1d
    monkeypatch.delattr(module, "torch_chunk_gated_delta_rule")
    with pytest.raises(seqpar.SeqParError, match="has no torch_chunk_gated_delta_rule"):
        layer_function(layer, "torch_chunk_gated_delta_rule")


def _equal_heads_only(inner):
    """A delta rule that, like transformers 5.17's torch function and FLA < 0.5, takes only equal q / k / v heads."""
    def rule(q, k, v, **kw):
        assert q.shape[2] == k.shape[2] == v.shape[2], f"grouped heads {q.shape[2]} / {v.shape[2]} passed"
        return inner(q, k, v, **kw)

    return rule


@pytest.mark.parametrize("grouped", [False, True], ids=["equal_heads", "grouped_heads"])
def test_delta_rule_gets_the_heads_it_takes(monkeypatch, grouped):
    """The tiny Qwen3.5 has 4 k heads and 8 v heads. Unless the model's module says its kernels take grouped heads
    (fla_needs_equal_qk_heads() False, recent transformers), q / k are repeated to the v heads as earlier layers'
    forwards do (a grouped call broke every Qwen3.5 step on transformers 5.17, seen on an H200)."""
    layer = find_linear_attention(tiny_model("qwen3_5", num_layers=2))[0]
    module = sys.modules[type(layer).__module__]
    inner = layer_function(layer, "torch_chunk_gated_delta_rule")
    seen = []

    def spy(q, k, v, **kw):
        seen.append(q.shape[2] == v.shape[2])
        return inner(q, k, v, **kw)

    if grouped:
        monkeypatch.setattr(module, "fla_needs_equal_qk_heads", lambda: False, raising=False)
        rule = Spy(spy)
    else:
        monkeypatch.delattr(module, "fla_needs_equal_qk_heads", raising=False)
        rule = Spy(_equal_heads_only(spy))
    errs = run_threaded(_world, 2, "qwen3_5", rule, timeout=120)
    assert max(errs) < 2e-5, errs
    assert rule.calls and set(seen) == {not grouped}
