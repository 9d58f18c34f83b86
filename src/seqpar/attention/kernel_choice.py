"""Which local attention kernel runs: what each can take, what 'auto' picks, and the refusals.

Pure functions of (device type, dtype, head_dim, GPU compute capability, cuDNN version, torch version, whether the
call trains), so the routing is tested without a GPU. The rules are those torch's own SDPA dispatcher applies to
the same CUDA ops (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, per release: `TORCH_RULES`), so a kernel
seqpar runs is one torch would run on those inputs, for training; where seqpar is stricter it says why.

| kernel    | device | dtypes                          | head_dim                        | GPU (torch >= 2.8) | GQA    |
|-----------|--------|---------------------------------|---------------------------------|--------------------|--------|
| flash     | CUDA   | fp16, bf16                      | multiple of 8, <= 256 (*)       | sm80 .. sm121      | native |
| cudnn     | CUDA   | fp16, bf16                      | multiple of 8, <= 128           | sm80 .. sm121      | native |
| efficient | CUDA   | fp32, fp16; bf16 on sm80+       | multiple of 8 (fp32: 4; 1 <sm80)| sm50 .. sm121      | copies |
| cpu       | CPU    | any floating                    | any                             | -                  | native |
| math      | any    | any floating                    | any                             | -                  | copies |
(*) training on sm86 / sm89 / sm120 / sm121 (A10, L4, L40S, RTX 3090 / 4090 / 5090): not 192 < head_dim <= 224.

'auto': CPU -> cpu; CUDA -> cudnn where torch's own SDPA puts cuDNN first (torch >= 2.10, cuDNN > 9.15, sm90 /
sm100 / sm103; any sm9x / sm10x from torch 2.13; measured 1.7x flash's fwd+bwd speed on an H200, docs/gpu.md),
unless the user activated FA3 / FA4; else flash where it can, else efficient, else math (fp64 always math).
flash is torch's flash op: FlashAttention-2 as torch ships it, or FA3 / FA4 where the user activated one
(torch.nn.attention.activate_flash_attention_impl): torch dispatches the same ops to it. Packed calls (several
documents in one call) always run flash's varlen op; the cudnn kernel also runs pieces with one query or one key
there (cuDNN refuses s_kv = 1 on every release and s_q = 1 before 2.9).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import SeqParError

__all__ = ["KernelSpec", "KERNELS", "KERNEL_NAMES", "ALIASES", "TorchRules", "TORCH_RULES", "torch_rules",
           "kernel_name_for", "kernel_problem", "resolve_kernel_name", "describe_choice", "device_capability",
           "check_kernel_name", "flash_implementation"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    devices: tuple[str, ...]  # device types it runs on ('meta': argument checks in CI)
    dtypes: tuple[torch.dtype, ...] | None  # None: any floating dtype
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
    # flash: head_dim % 8 is the op's own check (mha_fwd); SDPA pads instead, seqpar calls the op
    "flash": KernelSpec("flash", ("cuda", "meta"), _HALF, 256, 8, varlen=True),
    # cudnn: torch allows 256 on sm90 with cuDNN >= 9.10 (check_cudnn_tensor_shapes, 2.9+), but its backward at 256
    # got a further check after 2.13 (check_cudnn_d256_bprop_head_dim): seqpar keeps to 128
    "cudnn": KernelSpec("cudnn", ("cuda", "meta"), _HALF, 128, 8),
    "efficient": KernelSpec("efficient", ("cuda", "meta"), (torch.float32, *_HALF), None, 8, 4),
}
KERNEL_NAMES = tuple(KERNELS)
ALIASES = {"cuda": "flash", "cuda_efficient": "efficient", "cuda_flash": "flash", "cuda_cudnn": "cudnn"}


@dataclass(frozen=True)
class TorchRules:
    """What one range of torch releases' SDPA dispatcher (cuda/sdp_utils.cpp) lets each fused op run for training.
    Capabilities are (major, minor); ranges are inclusive."""

    since: tuple[int, int]  # the first release these rules hold for
    flash_sm: tuple[tuple[int, int], tuple[int, int]]  # check_flash_attention_hardware_support
    efficient_sm: tuple[tuple[int, int], tuple[int, int]]  # check_mem_efficient_hardware_support
    cudnn_sm: tuple[tuple[int, int], tuple[int, int]] | None  # check_cudnn_hardware_support (None: seqpar refuses)
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89[_or_120]: flash backward refused for
    # 192 < head_dim <= 224 on these GPUs
    flash_grad_gate: tuple[tuple[int, int], ...]
    # cuDNN first in 'auto' (sdp_utils.cpp priority order): (cuDNN above this version, on these majors, minors;
    # None = any minor); None: torch never puts it first
    cudnn_first: tuple[int, tuple[int, ...], tuple[int, ...] | None] | None = None


_SM86_89 = ((8, 6), (8, 7), (8, 9))
TORCH_RULES: tuple[TorchRules, ...] = (
    # 2.6: sm80..sm90; cuDNN's GQA (enable_gqa) is not checked before 2.8, so seqpar does not run cudnn there
    TorchRules((2, 6), ((8, 0), (9, 0)), ((5, 0), (9, 0)), None, _SM86_89),
    TorchRules((2, 7), ((8, 0), (12, 0)), ((5, 0), (12, 0)), None, (*_SM86_89, (12, 0))),
    # 2.8: sm121 admitted; cuDNN with enable_gqa (check_batch_size_and_num_heads_dense<true, false>)
    TorchRules((2, 8), ((8, 0), (12, 1)), ((5, 0), (12, 1)), ((8, 0), (12, 1)), (*_SM86_89, (12, 0), (12, 1))),
    # 2.10: cuDNN first on sm90 / sm100 / sm103 with cuDNN > 9.15.0 (unless TORCH_CUDNN_SDPA_DEPRIORITIZED)
    TorchRules((2, 10), ((8, 0), (12, 1)), ((5, 0), (12, 1)), ((8, 0), (12, 1)), (*_SM86_89, (12, 0), (12, 1)),
               (91500, (9, 10), (0, 3))),
    # 2.13: any sm9x / sm10x
    TorchRules((2, 13), ((8, 0), (12, 1)), ((5, 0), (12, 1)), ((8, 0), (12, 1)), (*_SM86_89, (12, 0), (12, 1)),
               (91500, (9, 10), None)),
)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@lru_cache(maxsize=8)
def torch_rules(version: tuple[int, int] | None = None) -> TorchRules:
    """The rules of the installed torch (or of `version`); releases after the last known one get its rules."""
    v = version or _version(torch.__version__)
    if v < TORCH_RULES[0].since:
        raise SeqParError(f"torch {v[0]}.{v[1]} is older than seqpar supports: install torch >= 2.6")
    return [r for r in TORCH_RULES if r.since <= v][-1]


def _in(cap: tuple[int, int], sm: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    return sm[0] <= cap <= sm[1]


def _sm(cap: tuple[int, int]) -> str:
    return f"sm{cap[0]}{cap[1]}"


def _gpu_problem(name: str, dtype, head_dim, cap: tuple[int, int], rules: TorchRules, training: bool) -> str | None:
    """The capability-dependent refusals (cap known)."""
    sm = {"flash": rules.flash_sm, "efficient": rules.efficient_sm, "cudnn": rules.cudnn_sm}[name]
    if sm is None:
        return f"needs torch >= 2.8 here (this torch {rules.since[0]}.{rules.since[1]}.x has no GQA check for cuDNN)"
    if not _in(cap, sm):
        return f"runs on GPUs {_sm(sm[0])} .. {_sm(sm[1])} with this torch, not {_sm(cap)}"
    if name == "efficient" and dtype == torch.bfloat16 and cap < (8, 0):
        return f"takes bf16 on sm80+ only (fp16 / fp32 on {_sm(cap)})"  # less_than_sm80_mem_efficient_dtypes
    if name == "flash" and training and head_dim is not None and 192 < head_dim <= 224 and cap in rules.flash_grad_gate:
        return f"cannot train with 192 < head_dim <= 224 on {_sm(cap)} (got {head_dim})"
    return None


def _head_dim_problem(spec: KernelSpec, dtype, head_dim: int, cap: tuple[int, int] | None) -> str | None:
    mult = spec.fp32_head_dim_multiple if dtype == torch.float32 and spec.fp32_head_dim_multiple else \
        spec.head_dim_multiple
    if spec.name == "efficient" and cap is not None and cap < (8, 0):  # minimum_gemm_alignment below sm80
        mult = 8 if dtype in _HALF and cap >= (7, 0) else 1
    if head_dim % mult:
        return f"needs head_dim a multiple of {mult}, got {head_dim}"
    if spec.max_head_dim is not None and head_dim > spec.max_head_dim:
        return f"takes head_dim <= {spec.max_head_dim}, got {head_dim}"
    return None


def kernel_problem(name: str, device_type: str, dtype: torch.dtype | None, head_dim: int | None = None,
                   capability: tuple[int, int] | None = None, *, training: bool = True,
                   torch_version: tuple[int, int] | None = None) -> str | None:
    """Why kernel `name` cannot run these inputs (None: it can). Unknown dtype / head_dim / capability pass."""
    spec = KERNELS[name]
    if device_type not in spec.devices:
        return f"runs on {'/'.join(d for d in spec.devices if d != 'meta')} tensors, not {device_type}"
    if dtype is not None and spec.dtypes is not None and dtype not in spec.dtypes:
        return f"does not support {dtype} (it takes {', '.join(map(str, spec.dtypes))})"
    if dtype is not None and not dtype.is_floating_point:
        return f"needs floating inputs, got {dtype}"
    if head_dim is not None and (why := _head_dim_problem(spec, dtype, head_dim, capability)):
        return why
    if capability is not None and name in ("flash", "efficient", "cudnn"):
        return _gpu_problem(name, dtype, head_dim, capability, torch_rules(torch_version), training)
    return None


def _cudnn_first(rules: TorchRules, cap: tuple[int, int] | None, cudnn_version: int | None) -> bool:
    if rules.cudnn_first is None or cap is None or cudnn_version is None:
        return False
    above, majors, minors = rules.cudnn_first
    return cudnn_version > above and cap[0] in majors and (minors is None or cap[1] in minors)


def kernel_name_for(device_type: str, dtype: torch.dtype, head_dim: int | None = None,
                    capability: tuple[int, int] | None = None, cudnn_version: int | None = None,
                    flash_impl: str = "FA2", *, training: bool = True,
                    torch_version: tuple[int, int] | None = None) -> str:
    """What 'auto' picks: cpu on CPUs; on CUDA cudnn where torch puts it first (unless FA3 / FA4 is active), then
    the first of flash, efficient that can run these inputs, else math (fp64, or a head_dim no fused kernel takes);
    math on other devices. Unknown capability or cuDNN version: not cudnn."""
    if device_type == "cpu":
        return "cpu"
    if device_type in ("cuda", "meta"):
        rules = torch_rules(torch_version)
        first = ("cudnn",) if flash_impl == "FA2" and _cudnn_first(rules, capability, cudnn_version) else ()
        for name in (*first, "flash", "efficient"):
            if kernel_problem(name, device_type, dtype, head_dim, capability, training=training,
                              torch_version=torch_version) is None:
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
                        head_dim: int | None = None, training: bool = True) -> str:
    """'auto' -> kernel_name_for(...); an explicit name is checked and refused with the fix (SeqParError)."""
    cap = device_capability(device)

    def auto() -> str:
        cudnn = torch.backends.cudnn.version() if cap is not None and torch.backends.cudnn.is_available() else None
        return kernel_name_for(device.type, dtype if dtype is not None else torch.bfloat16, head_dim, cap, cudnn,
                               flash_implementation(), training=training)

    if name == "auto":
        return auto()
    name = check_kernel_name(name)
    why = kernel_problem(name, device.type, dtype, head_dim, cap, training=training)
    if why is not None:
        raise SeqParError(f"attention kernel {name!r} {why}: use attention_kernel 'auto' (picks {auto()!r} here) "
                          "or 'math'")
    return name


def describe_choice(device: torch.device, name: str, dtype: torch.dtype, head_dim: int | None = None,
                    training: bool = True) -> str:
    """One line for the run's log: the kernel, why, and (flash) which FlashAttention torch dispatches to."""
    chosen = resolve_kernel_name(device, name, dtype, head_dim, training)
    cap = device_capability(device)
    where = f"{device.type}" + (f" sm{cap[0]}{cap[1]}" if cap else "")
    how = "auto" if name == "auto" else "forced"
    line = f"attention kernel: {chosen} ({how}; {where}, {dtype}, head_dim {head_dim}, torch {torch.__version__})"
    if chosen == "flash":
        line += f", flash implementation {flash_implementation()}"
    return line


def flash_implementation() -> str:
    """The FlashAttention torch's flash ops dispatch to: 'FA2' (built in) or the activated FA3 / FA4."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    impl = current() if current is not None else None
    return impl or "FA2"
