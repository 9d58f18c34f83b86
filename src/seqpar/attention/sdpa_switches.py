"""torch's runtime SDPA switches, as its dispatcher reads them, for kernel_choice's 'auto' and refusals.

Read on every call (`SdpaSwitches.current()`), never cached: a switch flipped between two calls changes the next
choice, as it changes torch's. What is read: the four `torch.backends.cuda.enable_*_sdp` switches, deterministic
mode and its warn_only flag (`torch.use_deterministic_algorithms`), the priority order
(`torch.nn.attention.sdpa_kernel(..., set_priority=True)`, on releases that have it), the environment variables
torch's check_prefer_cudnn_attention reads (torch reads them once per process; seqpar on every call), and the CUDA
version torch was built with (2.13's rule for which GPUs put cuDNN first depends on it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["SdpaSwitches", "BACKEND_NAMES", "DEFAULT_ORDER", "CUDNN_ENV"]

# at::SDPBackend's values -> seqpar's kernel names (overrideable: a third-party backend seqpar never runs)
BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
# at::Context's sdp_priority_order before anything changes it (ATen/Context.h)
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn", "overrideable")
# check_prefer_cudnn_attention's variables: 2.9 TORCH_CUDNN_SDPA_PREFERRED=0 turns the preference off,
# 2.10+ TORCH_CUDNN_SDPA_DEPRIORITIZED=1 does
CUDNN_ENV = ("TORCH_CUDNN_SDPA_PREFERRED", "TORCH_CUDNN_SDPA_DEPRIORITIZED")


@dataclass(frozen=True)
class SdpaSwitches:
    flash: bool = True
    efficient: bool = True
    cudnn: bool = True
    math: bool = True
    deterministic: bool = False
    warn_only: bool = False
    order: tuple[str, ...] = DEFAULT_ORDER  # torch's priority order, as kernel names
    env: tuple[tuple[str, str], ...] = ()  # CUDNN_ENV values that are set
    cuda_major: int | None = None  # the CUDA torch was built with (None: a CPU build)

    @classmethod
    def current(cls) -> SdpaSwitches:
        """The switches as they are now."""
        b = torch.backends.cuda
        get_order = getattr(torch._C, "_get_sdp_priority_order", None)
        order = tuple(BACKEND_NAMES.get(int(i), str(i)) for i in get_order()) if get_order else DEFAULT_ORDER
        cuda = torch.version.cuda
        return cls(b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled(),
                   torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), order,
                   tuple((k, os.environ[k]) for k in CUDNN_ENV if k in os.environ),
                   int(cuda.split(".")[0]) if cuda else None)

    def env_value(self, name: str) -> str | None:
        return dict(self.env).get(name)

    def problem(self, name: str) -> str | None:
        """Why torch's switches rule kernel `name` out (None: they let it run)."""
        off = {"flash": "flash", "cpu": "flash", "efficient": "mem_efficient", "cudnn": "cudnn", "math": "math"}
        if name in off and not getattr(self, "efficient" if name == "efficient" else
                                       "flash" if name == "cpu" else name):
            return f"is switched off (torch.backends.cuda.enable_{off[name]}_sdp(False))"
        if name == "cudnn" and self.deterministic and not self.warn_only:
            # check_cudnn_deterministic: torch refuses cuDNN SDPA in deterministic mode unless warn_only
            return "is not deterministic and torch.use_deterministic_algorithms(True) is set (warn_only=True allows it)"
        return None

    def describe(self) -> str:
        on = [n for n in ("flash", "efficient", "cudnn", "math") if getattr(self, n)]
        det = " warn_only" if self.warn_only else ""
        return (f"enabled: {', '.join(on) or 'none'}; deterministic: {self.deterministic}{det}; "
                f"priority: {', '.join(self.order)}")
