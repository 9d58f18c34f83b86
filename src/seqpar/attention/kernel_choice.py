"""Which local attention kernel runs: what each can take, what 'auto' picks, and the refusals.

Pure functions of (device type, dtype, head_dim, GPU compute capability), so the routing is tested without a
GPU. The limits are those torch's own SDPA dispatcher checks for the same CUDA ops (sdp_utils.cpp), so a
kernel seqpar picks is one torch would run on those inputs:

| kernel    | device | dtypes             | head_dim                  | GPU       | varlen | GQA     |
|-----------|--------|--------------------|---------------------------|-----------|--------|---------|
| flash     | CUDA   | fp16, bf16         | multiple of 8, <= 256     | sm80+     | yes    | native  |
| cudnn     | CUDA   | fp16, bf16         | multiple of 8, <= 128     | sm80+     | flash's| native  |
| efficient | CUDA   | fp32, fp16, bf16   | multiple of 8 (4 in fp32) | sm50+     | no     | copies  |
| cpu       | CPU    | any floating       | any                       | -         | no     | native  |
| math      | any    | any floating       | any                       | -         | no     | copies  |

'auto': CPU -> cpu; CUDA -> cudnn on Hopper and newer (sm90+, cuDNN >= 9; measured 1.7x flash's fwd+bwd
speed at 8K and 32K on an H200, docs/gpu.md) unless the user activated FA3 / FA4, else flash where it can,
else efficient, else math (fp64 always math). flash is torch's flash op: FlashAttention-2 as torch ships it,
or FA3 / FA4 where the user activated one (torch.nn.attention.activate_flash_attention_impl): torch
dispatches the same ops to it. Packed calls (several documents in one call) always run flash's varlen op.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import SeqParError

__all__ = ["KernelSpec", "KERNELS", "KERNEL_NAMES", "ALIASES", "kernel_name_for", "kernel_problem",
           "resolve_kernel_name", "describe_choice", "device_capability", "check_kernel_name", "flash_implementation"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    devices: tuple[str, ...]  # device types it runs on ('meta': argument checks in CI)
    dtypes: tuple[torch.dtype, ...] | None  # None: any floating dtype
    min_capability: tuple[int, int] | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    fp32_head_dim_multiple: int | None = None
    varlen: bool = False


KERNELS: dict[str, KernelSpec] = {
    "cpu": KernelSpec("cpu", ("cpu",), None),
    # the CPU kernel holding CUDA's backward workspace (kernels.CudaWorkspaceOnCpu): the planner's CUDA terms
    # measured by the CPU meter
    "cpu_cuda_workspace": KernelSpec("cpu_cuda_workspace", ("cpu",), None),
    "math": KernelSpec("math", ("cpu", "cuda", "meta", "mps", "xpu"), None),
    "flash": KernelSpec("flash", ("cuda", "meta"), _HALF, (8, 0), 256, 8, varlen=True),
    "cudnn": KernelSpec("cudnn", ("cuda", "meta"), _HALF, (8, 0), 128, 8),
    "efficient": KernelSpec("efficient", ("cuda", "meta"), (torch.float32, *_HALF), (5, 0), None, 8, 4),
}
KERNEL_NAMES = tuple(KERNELS)
ALIASES = {"cuda": "flash", "cuda_efficient": "efficient", "cuda_flash": "flash", "cuda_cudnn": "cudnn"}


def kernel_problem(name: str, device_type: str, dtype: torch.dtype | None, head_dim: int | None = None,
                   capability: tuple[int, int] | None = None) -> str | None:
    """Why kernel `name` cannot run these inputs (None: it can). Unknown dtype/head_dim/capability pass."""
    spec = KERNELS[name]
    if device_type not in spec.devices:
        return f"runs on {'/'.join(d for d in spec.devices if d != 'meta')} tensors, not {device_type}"
    if dtype is not None and spec.dtypes is not None and dtype not in spec.dtypes:
        return f"does not support {dtype} (it takes {', '.join(map(str, spec.dtypes))})"
    if dtype is not None and not dtype.is_floating_point:
        return f"needs floating inputs, got {dtype}"
    if capability is not None and spec.min_capability is not None and capability < spec.min_capability:
        need, have = ".".join(map(str, spec.min_capability)), f"sm{capability[0]}{capability[1]}"
        return f"needs a GPU of compute capability {need}+ ({have} here)"
    if head_dim is not None:
        mult = spec.fp32_head_dim_multiple if dtype == torch.float32 and spec.fp32_head_dim_multiple else \
            spec.head_dim_multiple
        if head_dim % mult:
            return f"needs head_dim a multiple of {mult}, got {head_dim}"
        if spec.max_head_dim is not None and head_dim > spec.max_head_dim:
            return f"takes head_dim <= {spec.max_head_dim}, got {head_dim}"
    return None


def kernel_name_for(device_type: str, dtype: torch.dtype, head_dim: int | None = None,
                    capability: tuple[int, int] | None = None, cudnn_version: int | None = None,
                    flash_impl: str = "FA2") -> str:
    """What 'auto' picks: cpu on CPUs; on CUDA cudnn on sm90+ with cuDNN >= 9 (unless FA3 / FA4 is active),
    then the first of flash, efficient that can run these inputs, else math (fp64 on CUDA, or a head_dim no
    fused kernel takes); math on other devices. Unknown capability or cuDNN version: not cudnn."""
    if device_type == "cpu":
        return "cpu"
    if device_type in ("cuda", "meta"):
        hopper = capability is not None and capability >= (9, 0) and (cudnn_version or 0) >= 90000
        first = ("cudnn",) if hopper and flash_impl == "FA2" else ()
        for name in (*first, "flash", "efficient"):
            if kernel_problem(name, device_type, dtype, head_dim, capability) is None:
                return name
    return "math"


@lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability (None for other devices, or without a driver)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def check_kernel_name(name: str) -> str:
    """'auto' or a known kernel name (old names mapped); SeqParError naming the choices otherwise."""
    if name == "auto":
        return name
    name = ALIASES.get(name, name)
    if name not in KERNELS:
        raise SeqParError(f"unknown attention kernel {name!r}: use 'auto' or one of {', '.join(KERNEL_NAMES)}")
    return name


def resolve_kernel_name(device: torch.device, name: str, dtype: torch.dtype | None = None,
                        head_dim: int | None = None) -> str:
    """'auto' -> kernel_name_for(...); an explicit name is checked and refused with the fix (SeqParError)."""
    cap = device_capability(device)
    cudnn = torch.backends.cudnn.version() if cap is not None and torch.backends.cudnn.is_available() else None
    if name == "auto":
        return kernel_name_for(device.type, dtype if dtype is not None else torch.bfloat16, head_dim, cap, cudnn,
                               flash_implementation())
    name = check_kernel_name(name)
    why = kernel_problem(name, device.type, dtype, head_dim, cap)
    if why is not None:
        auto = kernel_name_for(device.type, dtype if dtype is not None else torch.bfloat16, head_dim, cap, cudnn,
                               flash_implementation())
        raise SeqParError(f"attention kernel {name!r} {why}: use attention_kernel 'auto' (picks {auto!r} here) "
                          "or 'math'")
    return name


def describe_choice(device: torch.device, name: str, dtype: torch.dtype, head_dim: int | None = None) -> str:
    """One line for the run's log: the kernel, why, and (flash) which FlashAttention torch dispatches to."""
    chosen = resolve_kernel_name(device, name, dtype, head_dim)
    cap = device_capability(device)
    where = f"{device.type}" + (f" sm{cap[0]}{cap[1]}" if cap else "")
    how = "auto" if name == "auto" else "forced"
    line = f"attention kernel: {chosen} ({how}; {where}, {dtype}, head_dim {head_dim})"
    if chosen == "flash":
        line += f", flash implementation {flash_implementation()}"
    return line


def flash_implementation() -> str:
    """The FlashAttention torch's flash ops dispatch to: 'FA2' (built in) or the activated FA3 / FA4."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    impl = current() if current is not None else None
    return impl or "FA2"
