"""'auto' against torch's own dispatcher on a real GPU (`make test-gpu`; skipped without CUDA): for the GPU this
runs on, kernel_choice's pick equals torch._fused_sdp_choice under torch's switches and deterministic mode."""

from __future__ import annotations

import itertools

import pytest
import torch

from seqpar.attention.kernel_choice import resolve_kernel_name

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def test_auto_equals_torchs_fused_sdp_choice():
    b = torch.backends.cuda
    saved = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    dev = torch.device("cuda")
    try:
        for dtype, d in itertools.product((torch.bfloat16, torch.float16, torch.float32), (64, 128)):
            q, k, v = (torch.randn(1, 4, 256, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
            torch._fused_sdp_choice(q, k, v, is_causal=True)  # torch sets its priority order at its first call
            for flash, eff, cudnn, det in itertools.product((True, False), (True, False), (True, False),
                                                             ("off", "on", "warn")):
                b.enable_flash_sdp(flash)
                b.enable_mem_efficient_sdp(eff)
                b.enable_cudnn_sdp(cudnn)
                torch.use_deterministic_algorithms(det != "off", warn_only=det == "warn")
                want = NAMES[int(torch._fused_sdp_choice(q, k, v, is_causal=True))]
                got = resolve_kernel_name(dev, "auto", dtype, d, training=True)
                assert got == want, (dtype, d, flash, eff, cudnn, det)
    finally:
        for fn, on in zip((b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_cudnn_sdp), saved):
            fn(on)
        torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
