"""The hybrid families' SP forwards run the GPU kernels the unsharded layer runs when their packages are installed:
causal-conv1d's `causal_conv1d_fn` (LFM2's short conv; Jamba's and Kimi-Linear's convs), mamba_ssm's
`selective_scan_fn` (Jamba's Mamba1 scan), flash-linear-attention's `chunk_kda` (Kimi-Linear) and
`chunk_gated_delta_rule` (OLMo-hybrid). On CPU, fake packages
with the kernels' documented signatures and argument rules (tests/kernel_fakes.py) are bound through transformers'
own dispatch, as the real ones would be; the unsharded layer and the SP forward (ring 2, Ulysses 2; one row and a
packed row of two documents) both run them. Checked: SP output equals the unsharded layer's (fp32, 2e-5), every
fake is called by the SP forward, and with the arguments state passing needs: the conv gets its halo as leading
tokens (no initial_states: causal-conv1d takes them channel-last only), the scan runs from zero and returns its last
state (mamba_ssm's scan takes no initial state: seqpar corrects the outputs in closed form), the delta rules get an
initial state on ring pieces that carry one and return their final state.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from kernel_fakes import CALLS, installed

import seqpar
from seqpar.hf import tiny_model
from seqpar.hf.layer_kernels import kernel_origin, layer_function
from seqpar.hf.recurrent_layers import find_recurrent, recurrent_forward
from seqpar.threaded import run_threaded

# arch: the module functions its first mixer calls, and the fake behind each
KERNELS = {"lfm2": ("causal_conv1d_fn",), "jamba": ("causal_conv1d_fn", "mamba_selective_scan"),
           "kimi_linear": ("causal_conv1d_fn", "chunk_kimi_delta_attention"),
           "olmo_hybrid": ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
SEQ, DOC = 40, 17  # one row of 40 tokens; packed: documents of 17 and 23 (a boundary inside rank 0's shard)


def _inputs(layer, hidden: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, SEQ, hidden] and the unsharded layer's output (each document alone when packed)."""
    x = torch.randn(1, SEQ, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return x, torch.cat([layer(d) for d in ((x[:, :DOC], x[:, DOC:]) if packed else (x,))], dim=1)


def _world(layer, x: torch.Tensor, ref: torch.Tensor, u: int, r: int, packed: bool) -> float:
    mesh = seqpar.init_mesh(2, ulysses_degree=u, ring_degree=r)
    layer = copy.deepcopy(layer)
    with torch.no_grad():
        out = recurrent_forward(layer)(layer, seqpar.shard(x, mesh, 1), None, ((DOC,) if packed else (),), mesh)
    return float((seqpar.unshard(out, mesh, 1) - ref).abs().max())


@pytest.mark.parametrize("arch", sorted(KERNELS))
def test_sp_forward_runs_the_installed_kernels(arch):
    model = tiny_model(arch)
    layer = find_recurrent(model)[0][0]
    module = sys.modules[type(layer).__module__]
    with installed(module, KERNELS[arch]):
        for name in KERNELS[arch]:  # transformers' dispatch chose the "installed" package, for both forwards
            assert kernel_origin(layer_function(layer, name)).split(".")[0] in ("causal_conv1d", "mamba_ssm", "fla")
        for packed in (False, True):
            x, ref = _inputs(layer, model.config.hidden_size, packed)  # through the fakes too
            assert all(CALLS.values()) and len(CALLS) == len(KERNELS[arch]), CALLS
            for u, r in ((1, 2), (2, 1)):
                CALLS.clear()  # from here on: the SP forward's calls only
                errs = run_threaded(_world, 2, layer, x, ref, u, r, packed, timeout=120)
                assert max(errs) < 2e-5, (u, r, packed, errs)
                _check_calls(arch, u, r)


def _check_calls(arch: str, u: int, r: int) -> None:
    """The SP forward ran each fake, with the arguments its state passing needs."""
    conv = CALLS["causal_conv1d_fn"]
    assert conv and not any(c["initial_states"] or c["return_final_states"] for c in conv), conv
    if arch == "jamba":  # mamba_ssm's scan from zero, its last state returned; Ulysses: the rank's 64 / U channels
        scans = CALLS["selective_scan_fn"]
        assert scans and all(c["return_last_state"] and c["delta_softplus"] and c["z"] and c["delta_bias"]
                             and c["shape"][1] == 64 // u for c in scans), scans
    if arch in ("kimi_linear", "olmo_hybrid"):  # the final state always; an initial state ([0 | I]) on ring pieces
        kda = CALLS["chunk_kda" if arch == "kimi_linear" else "chunk_gated_delta_rule"]
        assert kda and all(c["l2norm"] and c["output_final_state"] for c in kda), kda
        assert any(c["initial_state"] for c in kda) == (r > 1), (r, kda)  # (that carry one)
