"""Which local attention kernel runs: what each can take, what 'auto' picks, and the refusals.

Pure functions of (device type, dtype, head_dim, GPU compute capability, cuDNN version, torch version, whether the
call trains, torch's runtime SDPA switches), so the routing is tested without a GPU. The rules are those torch's own
SDPA dispatcher applies to the same CUDA ops (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, per release:
`TORCH_RULES`; the CPU one in sdp_utils_cpp.cpp), so a kernel seqpar runs is one torch would run on those inputs,
for training; where seqpar is stricter it says why.

| kernel    | device | dtypes                          | head_dim                        | GPU (torch >= 2.8) | GQA    |
|-----------|--------|---------------------------------|---------------------------------|--------------------|--------|
| flash     | CUDA   | fp16, bf16                      | multiple of 8, <= 256 (*)       | sm80 .. sm121      | native |
| cudnn     | CUDA   | fp16, bf16 (cuDNN >= 9.0)       | multiple of 8, <= 128 (**)      | sm80 .. sm121      | native |
| efficient | CUDA   | fp32, fp16; bf16 on sm80+       | multiple of 8 (fp32: 4; 1 <sm80)| sm50 .. sm121      | copies |
| cpu       | CPU    | any floating                    | any                             | -                  | native |
| math      | any    | any floating                    | any                             | -                  | copies |
(*) training on sm86 / sm89 / sm120 / sm121 (A10, L4, L40S, RTX 3090 / 4090 / 5090): not 192 < head_dim <= 224.
(**) torch's check_cudnn_tensor_shapes takes more on sm90 / sm10x: 2.9 - 2.12 up to 256 on sm90 from cuDNN 9.10
with no backward check; later sources 256 only with cuDNN > 9.22 and a cuDNN frontend >= 1.24 (a build fact
Python cannot read), and check_cudnn_d256_bprop_head_dim lets the backward take only head_dim <= 128, 192 / 128 or
256 / 256. seqpar keeps cudnn to 128, so 'auto' picks flash where torch would run cuDNN above 128.

'auto' = torch's select_sdp_backend, read when the kernel is chosen (`SdpaSwitches.current()`): the backends in
torch's priority order (at::Context's default flash, efficient, math, cuDNN; cuDNN first where
check_prefer_cudnn_attention says so, `TorchRules.cudnn_first`; a user's `torch.nn.attention.sdpa_kernel(...,
set_priority=True)` order as set), each skipped when its `torch.backends.cuda.enable_*_sdp` switch is off, cuDNN
also under `torch.use_deterministic_algorithms(True)` unless warn_only (check_cudnn_deterministic), math only when
enabled; none left: SeqParError. CPU: the CPU flash kernel ('cpu', the flash switch), else math. flash is torch's
flash op: FlashAttention-2 as torch ships it, or FA3 / FA4 where the user activated one
(torch.nn.attention.activate_flash_attention_impl): torch's dispatcher keeps its order then too. Packed calls
(several documents in one call) always run flash's varlen op; the cudnn kernel also runs pieces with one query or
one key there (cuDNN refuses s_kv = 1 on every release and s_q = 1 before 2.9).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import SeqParError
from .sdpa_switches import DEFAULT_ORDER, SdpaSwitches

__all__ = ["KernelSpec", "KERNELS", "KERNEL_NAMES", "ALIASES", "CudnnFirst", "TorchRules", "TORCH_RULES",
           "torch_rules", "SdpaSwitches", "torch_order", "cudnn_first", "kernel_name_for", "kernel_problem",
           "resolve_kernel_name", "describe_choice", "device_capability", "check_kernel_name", "flash_implementation"]

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
    # cudnn: seqpar keeps to head_dim 128 (the module docstring's (**): what torch takes above it depends on the
    # cuDNN frontend torch was built with, and the backward takes only some head_dims there)
    "cudnn": KernelSpec("cudnn", ("cuda", "meta"), _HALF, 128, 8),
    "efficient": KernelSpec("efficient", ("cuda", "meta"), (torch.float32, *_HALF), None, 8, 4),
}
KERNEL_NAMES = tuple(KERNELS)
ALIASES = {"cuda": "flash", "cuda_efficient": "efficient", "cuda_flash": "flash", "cuda_cudnn": "cudnn"}


@dataclass(frozen=True)
class CudnnFirst:
    """check_prefer_cudnn_attention: when torch's default order puts cuDNN first (majors 9 and 10 only)."""

    cudnn_above: int  # the cuDNN version must be above this
    minors: tuple[int, ...]  # of those majors
    env: str  # the variable that turns the preference off ...
    off: str  # ... when set to this (c10::utils::check_env: '0' / '1')
    any_minor_from_cuda: int | None = None  # torch built with this CUDA major or later: any minor


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
    cudnn_first: CudnnFirst | None = None  # None: the default order never changes (cuDNN after math)


_CUDNN_ORDER = ("cudnn", "flash", "efficient", "math")  # priority_order()'s order where cuDNN is preferred
_SM86_89 = ((8, 6), (8, 7), (8, 9))
_GATE_120 = (*_SM86_89, (12, 0), (12, 1))
_ALL = ((8, 0), (12, 1)), ((5, 0), (12, 1)), ((8, 0), (12, 1))
# 2.10's check_prefer_cudnn_attention: runtime cuDNN > 9.15.0 (the seq_len % 128 fix), minors 0 (sm90 / sm100)
# and 3 (sm103)
_CUDNN_FIRST_2_10 = CudnnFirst(91500, (0, 3), "TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
TORCH_RULES: tuple[TorchRules, ...] = (
    # 2.6: sm80..sm90; cuDNN's GQA (enable_gqa) is not checked before 2.8, so seqpar does not run cudnn there
    TorchRules((2, 6), ((8, 0), (9, 0)), ((5, 0), (9, 0)), None, _SM86_89),
    TorchRules((2, 7), ((8, 0), (12, 0)), ((5, 0), (12, 0)), None, (*_SM86_89, (12, 0))),
    # 2.8: sm121 admitted; cuDNN with enable_gqa (check_batch_size_and_num_heads_dense<true, false>)
    TorchRules((2, 8), *_ALL, _GATE_120),
    # 2.9: cuDNN first when built with cuDNN >= 9.9.0 (CUDNN_VERSION; seqpar compares the runtime version) on
    # minor 0 of majors 9 / 10 (sm90, sm100), unless TORCH_CUDNN_SDPA_PREFERRED=0
    TorchRules((2, 9), *_ALL, _GATE_120, CudnnFirst(90899, (0,), "TORCH_CUDNN_SDPA_PREFERRED", "0")),
    TorchRules((2, 10), *_ALL, _GATE_120, _CUDNN_FIRST_2_10),
    # 2.13: built with CUDA < 13 as 2.10; CUDA 13 builds any minor of majors 9 / 10
    TorchRules((2, 13), *_ALL, _GATE_120, CudnnFirst(91500, (0, 3), "TORCH_CUDNN_SDPA_DEPRIORITIZED", "1", 13)),
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
                   torch_version: tuple[int, int] | None = None, cudnn_version: int | None = None) -> str | None:
    """Why kernel `name` cannot run these inputs (None: it can). Unknown dtype / head_dim / capability / cuDNN
    version pass. torch's runtime switches are SdpaSwitches.problem's."""
    spec = KERNELS[name]
    if device_type not in spec.devices:
        return f"runs on {'/'.join(d for d in spec.devices if d != 'meta')} tensors, not {device_type}"
    if dtype is not None and spec.dtypes is not None and dtype not in spec.dtypes:
        return f"does not support {dtype} (it takes {', '.join(map(str, spec.dtypes))})"
    if dtype is not None and not dtype.is_floating_point:
        return f"needs floating inputs, got {dtype}"
    if name == "cudnn" and cudnn_version is not None and cudnn_version < 90000:
        # can_use_cudnn_attention: "cuDNN version too old to use cuDNN Attention (< v9.0.0)"
        return f"needs cuDNN >= 9.0 (this torch has {_cudnn_text(cudnn_version)})"
    if head_dim is not None and (why := _head_dim_problem(spec, dtype, head_dim, capability)):
        return why
    if capability is not None and name in ("flash", "efficient", "cudnn"):
        return _gpu_problem(name, dtype, head_dim, capability, torch_rules(torch_version), training)
    return None


def _cudnn_text(version: int) -> str:
    if version <= 0:
        return "no cuDNN"
    major = version // 10000 if version >= 90000 else version // 1000  # cuDNN 9 counts minors by 100s, 8 by 10s
    return f"cuDNN {major}.{version // 100 % (100 if version >= 90000 else 10)}.{version % 100}"


def cudnn_first(rules: TorchRules, cap: tuple[int, int] | None, cudnn_version: int | None,
                switches: SdpaSwitches) -> bool:
    """check_prefer_cudnn_attention of this release: cuDNN first in the default order on this GPU."""
    rule = rules.cudnn_first
    if rule is None or cap is None or cudnn_version is None or switches.env_value(rule.env) == rule.off:
        return False
    any_minor = rule.any_minor_from_cuda is not None and (switches.cuda_major or 0) >= rule.any_minor_from_cuda
    return cudnn_version > rule.cudnn_above and cap[0] in (9, 10) and (any_minor or cap[1] in rule.minors)


def torch_order(rules: TorchRules, cap: tuple[int, int] | None, cudnn_version: int | None,
                switches: SdpaSwitches) -> tuple[str, ...]:
    """The backends in the order torch's select_sdp_backend tries them. torch's priority_order() replaces the
    default order by cuDNN, flash, efficient, math once, at the first SDPA call, where cuDNN is preferred; an order
    the user set is kept (one set back to exactly the default after that first call reads as the default here)."""
    order = switches.order
    if order == DEFAULT_ORDER and cudnn_first(rules, cap, cudnn_version, switches):
        order = _CUDNN_ORDER
    return tuple(n for n in order if n in KERNELS)


def kernel_name_for(device_type: str, dtype: torch.dtype, head_dim: int | None = None,
                    capability: tuple[int, int] | None = None, cudnn_version: int | None = None, *,
                    training: bool = True, torch_version: tuple[int, int] | None = None,
                    switches: SdpaSwitches | None = None) -> str:
    """What 'auto' picks (the module docstring): torch's choice for these inputs under `switches` (default: torch's
    switches as they are now). cpu on CPUs, else math; on CUDA the first backend in torch's order that the switches
    and the inputs allow; math on other devices. Unknown capability or cuDNN version: not cudnn. Nothing allowed:
    SeqParError (torch's "No available kernel")."""
    sw = switches if switches is not None else SdpaSwitches.current()
    if device_type == "cpu":
        order: tuple[str, ...] = ("cpu", "math")  # select_sdp_backend_cpp: the CPU flash kernel, then math
    elif device_type in ("cuda", "meta"):
        order = torch_order(torch_rules(torch_version), capability, cudnn_version, sw)
    else:
        return "math"
    for name in order:
        if name == "cudnn" and (capability is None or cudnn_version is None):
            continue
        if sw.problem(name) is None and kernel_problem(name, device_type, dtype, head_dim, capability,
                                                       training=training, torch_version=torch_version,
                                                       cudnn_version=cudnn_version) is None:
            return name
    raise SeqParError(f"no attention kernel can run {dtype} with head_dim {head_dim} on {device_type} under "
                      f"torch's SDPA switches ({sw.describe()}): enable one that can "
                      "(torch.backends.cuda.enable_math_sdp(True) always can)")


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


def _cudnn_version(cap: tuple[int, int] | None) -> int | None:
    """The runtime cuDNN version on a CUDA device (0: torch has none; None: no CUDA device)."""
    if cap is None:
        return None
    return (torch.backends.cudnn.version() or 0) if torch.backends.cudnn.is_available() else 0


def resolve_kernel_name(device: torch.device, name: str, dtype: torch.dtype | None = None,
                        head_dim: int | None = None, training: bool = True) -> str:
    """'auto' -> kernel_name_for(...) with torch's switches as they are now; an explicit name is checked against
    the inputs and those switches, and refused with the fix (SeqParError)."""
    cap = device_capability(device)
    cudnn = _cudnn_version(cap)
    switches = SdpaSwitches.current()

    def auto() -> str:
        return kernel_name_for(device.type, dtype if dtype is not None else torch.bfloat16, head_dim, cap, cudnn,
                               training=training, switches=switches)

    if name == "auto":
        return auto()
    name = check_kernel_name(name)
    why = kernel_problem(name, device.type, dtype, head_dim, cap, training=training, cudnn_version=cudnn)
    if why is None:
        why = switches.problem(name)
    if why is not None:
        try:
            fix = f"attention_kernel 'auto' (picks {auto()!r} here) or 'math'"
        except SeqParError as e:
            fix = str(e)
        raise SeqParError(f"attention kernel {name!r} {why}: use {fix}")
    return name


def describe_choice(device: torch.device, name: str, dtype: torch.dtype, head_dim: int | None = None,
                    training: bool = True) -> str:
    """One line for the run's log: the kernel, why, and (flash) which FlashAttention torch dispatches to."""
    chosen = resolve_kernel_name(device, name, dtype, head_dim, training)
    cap = device_capability(device)
    where = f"{device.type}" + (f" sm{cap[0]}{cap[1]}" if cap else "")
    how = "auto" if name == "auto" else "forced"
    line = f"attention kernel: {chosen} ({how}; {where}, {dtype}, head_dim {head_dim}, torch {torch.__version__})"
    sw = SdpaSwitches.current()
    # the switches when the user changed them (torch's own cuDNN-first order, set at its first SDPA call, is not)
    if sw != SdpaSwitches(order=sw.order, env=sw.env, cuda_major=sw.cuda_major) or \
            sw.order not in (DEFAULT_ORDER, _CUDNN_ORDER + ("overrideable",)):
        line += f", SDPA switches {sw.describe()}"
    if chosen == "flash":
        line += f", flash implementation {flash_implementation()}"
    return line


def flash_implementation() -> str:
    """The FlashAttention torch's flash ops dispatch to: 'FA2' (built in) or the activated FA3 / FA4."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    impl = current() if current is not None else None
    return impl or "FA2"
