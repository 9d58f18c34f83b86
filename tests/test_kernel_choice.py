"""attention.kernel_choice: 'auto' is torch's own SDPA choice, per release, GPU, cuDNN, dtype, head_dim, training and
torch's runtime switches (read when the kernel is chosen), and an explicit kernel is refused where torch's
dispatcher would refuse it. GPU-free: the rules are pure functions; the switches are set through torch's own APIs.

`torch_pick` below re-derives torch's select_sdp_backend (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)
independently of seqpar's tables; the enumeration compares 'auto' with it under every switch combination."""

from __future__ import annotations

import itertools

import pytest
import torch

from seqpar.attention.kernel_choice import kernel_name_for, kernel_problem, torch_rules
from seqpar.errors import SeqParError

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
ORDER_IDS = {"math": 0, "flash": 1, "efficient": 2, "cudnn": 3, "overrideable": 4}
DEFAULT = ("flash", "efficient", "math", "cudnn", "overrideable")  # ATen/Context.h sdp_priority_order


@pytest.fixture
def sdpa_state():
    """Restores torch's SDPA switches, deterministic mode and priority order after the test."""
    b = torch.backends.cuda
    saved = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled(),
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             list(torch._C._get_sdp_priority_order()))
    yield
    for fn, on in zip((b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_cudnn_sdp, b.enable_math_sdp), saved):
        fn(on)
    torch.use_deterministic_algorithms(saved[4], warn_only=saved[5])
    torch._C._set_sdp_priority_order(saved[6])


def set_switches(flash=True, efficient=True, cudnn=True, math=True, det="off", order=DEFAULT):
    b = torch.backends.cuda
    b.enable_flash_sdp(flash)
    b.enable_mem_efficient_sdp(efficient)
    b.enable_cudnn_sdp(cudnn)
    b.enable_math_sdp(math)
    torch.use_deterministic_algorithms(det != "off", warn_only=det == "warn")
    torch._C._set_sdp_priority_order([ORDER_IDS[n] for n in order])


# ----------------------------------------------------------------------------- torch's dispatcher, re-derived
def _sm(cap, lo, hi):
    return lo <= cap <= hi


def _prefers_cudnn(rel, cap, cudnn, cuda, env):
    """check_prefer_cudnn_attention per release (sdp_utils.cpp)."""
    if rel < (2, 9):
        return False  # priority_order(): the fixed default order (cuDNN after math)
    if rel < (2, 10):  # CUDNN_VERSION >= 90900; (major == 9 || major == 10) && !minor; TORCH_CUDNN_SDPA_PREFERRED
        return env.get("TORCH_CUDNN_SDPA_PREFERRED") != "0" and cudnn >= 90900 and cap in ((9, 0), (10, 0))
    if env.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1":
        return False
    # 2.10: cudnn_version > 91500 && major 9 / 10 && (!minor || minor == 3); 2.13: that under CUDA_VERSION < 13000,
    # any minor otherwise
    any_minor = rel >= (2, 13) and cuda >= 13
    return cudnn > 91500 and cap[0] in (9, 10) and (any_minor or cap[1] in (0, 3))


def _can_flash(rel, cap, dtype, d, training):
    hi = (9, 0) if rel < (2, 7) else (12, 0) if rel < (2, 8) else (12, 1)  # check_flash_attention_hardware_support
    gate = ((8, 6), (8, 7), (8, 9)) + (((12, 0),) if rel >= (2, 7) else ()) + (((12, 1),) if rel >= (2, 8) else ())
    return (_sm(cap, (8, 0), hi) and dtype in (F16, BF16)  # check_dtypes_low_precision
            and d % 8 == 0 and d <= 256  # check_head_dim_size_flash (<= 256); % 8: mha_fwd, the op seqpar calls
            and not (training and cap in gate and 192 < d <= 224))  # ..._gt192_constraints_on_sm86_89_or_120


def _can_efficient(rel, cap, dtype, d):
    hi = (9, 0) if rel < (2, 7) else (12, 0) if rel < (2, 8) else (12, 1)  # check_mem_efficient_hardware_support
    half = dtype in (F16, BF16)
    tensor_cores = cap >= (8, 0) or (cap >= (7, 0) and half)  # use_tensor_cores
    align = max(4 if cap >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)  # minimum_gemm_alignment
    dtypes = (F16, F32, BF16) if cap >= (8, 0) else (F16, F32)  # (greater|less)_than_sm80_mem_efficient_dtypes
    return _sm(cap, (5, 0), hi) and dtype in dtypes and d % align == 0


def _can_cudnn(cap, dtype, d, cudnn, det):
    return (det != "on"  # check_cudnn_deterministic (warn_only lets it run)
            and cudnn >= 90000  # can_use_cudnn_attention: cuDNN < 9.0 too old
            and _sm(cap, (8, 0), (12, 1)) and dtype in (F16, BF16)  # hardware, check_dtypes_low_precision
            and d % 8 == 0 and d <= 128)  # check_cudnn_tensor_shapes (seqpar's 128: the module docstring's (**))


def torch_pick(rel, cap, cudnn, cuda, dtype, d, training, enabled, det, order, env):
    """select_sdp_backend: the first backend of the priority order that is enabled and can run; None: error."""
    if order == DEFAULT and _prefers_cudnn(rel, cap, cudnn, cuda, env):
        order = ("cudnn", "flash", "efficient", "math")  # priority_order(): set once at the first call
    can = {"flash": lambda: _can_flash(rel, cap, dtype, d, training),
           "efficient": lambda: _can_efficient(rel, cap, dtype, d),
           "cudnn": lambda: _can_cudnn(cap, dtype, d, cudnn, det), "math": lambda: True,
           "overrideable": lambda: False}
    return next((n for n in order if enabled[n] and can[n]()), None)


ORDERS = (DEFAULT, ("cudnn", "flash", "efficient", "math", "overrideable"),
          ("efficient", "cudnn", "flash", "math", "overrideable"), ("math", "flash", "efficient", "cudnn",
                                                                    "overrideable"))
ENVS = ({}, {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1", "TORCH_CUDNN_SDPA_PREFERRED": "0"})
GPUS = ((7, 5), (8, 0), (8, 6), (9, 0), (9, 4), (10, 3), (12, 0))


class _Cuda:  # a CUDA build's version for SdpaSwitches (this test machine's torch is a CPU build)
    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def set(self, major):
        self.mp.setattr(torch.version, "cuda", f"{major}.0")


@pytest.mark.parametrize("rel", [(2, 8), (2, 9), (2, 10), (2, 13)], ids=lambda r: f"torch{r[0]}.{r[1]}")
def test_auto_is_torchs_choice_under_every_switch_combination(rel, sdpa_state, monkeypatch):
    """16 enable_* combinations x deterministic off / on / warn_only x 4 priority orders x both cuDNN variables,
    set through torch's APIs and read by kernel_name_for's defaults, on 7 GPUs, 2 cuDNN and 2 CUDA versions,
    4 dtypes, 3 head_dims, training or not: 'auto' = torch_pick, or SeqParError where torch has no kernel."""
    cuda = _Cuda(monkeypatch)
    inputs = list(itertools.product(GPUS, (91000, 91900), (12, 13), (F16, BF16, F32, F64), (64, 200), (True, False)))
    checked = 0
    for on in itertools.product((True, False), repeat=4):
        enabled = dict(zip(("flash", "efficient", "cudnn", "math"), on), overrideable=False)
        for det, order, env in itertools.product(("off", "on", "warn"), ORDERS, ENVS):
            if env and (order != DEFAULT or det != "off"):
                continue  # the variables only matter for the default order
            set_switches(*on, det=det, order=order)
            for k in ENVS[1]:
                monkeypatch.delenv(k, raising=False)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            for cap, cudnn, cu, dtype, d, training in inputs[checked % 7::7]:  # every input over the combinations
                cuda.set(cu)
                want = torch_pick(rel, cap, cudnn, cu, dtype, d, training, enabled, det, order, env)
                if want is None:
                    with pytest.raises(SeqParError, match="no attention kernel can run"):
                        kernel_name_for("cuda", dtype, d, cap, cudnn, training=training, torch_version=rel)
                else:
                    got = kernel_name_for("cuda", dtype, d, cap, cudnn, training=training, torch_version=rel)
                    assert got == want, (cap, cudnn, cu, dtype, d, training, enabled, det, order, env)
                checked += 1
    assert checked > 10_000


# ----------------------------------------------------------------------------- the table, one torch rule per row
# (torch, capability, cuDNN, dtype, head_dim, training, what 'auto' picks, the sdp_utils.cpp rule that decides)
ROUTES = [
    ("2.13", (9, 0), 91900, BF16, 128, True, "cudnn",
     "check_prefer_cudnn_attention 2.10+: cudnn_version > 91500, major 9 or 10, minor 0 or 3"),
    ("2.13", (9, 0), 91500, BF16, 128, True, "flash", "check_prefer_cudnn_attention: 9.15.0 is not > 91500"),
    ("2.11", (10, 3), 91900, BF16, 128, True, "cudnn", "check_prefer_cudnn_attention 2.10+: minor == 3 (sm103)"),
    ("2.11", (9, 4), 91900, BF16, 128, True, "flash", "check_prefer_cudnn_attention 2.10-2.12: minor 0 or 3 only"),
    ("2.13", (9, 4), 91900, BF16, 128, True, "flash",
     "check_prefer_cudnn_attention 2.13, CUDA_VERSION < 13000 branch: minor 0 or 3 only"),
    ("2.9", (9, 0), 91000, BF16, 128, True, "cudnn",
     "check_prefer_cudnn_attention 2.9: CUDNN_VERSION >= 90900, major 9 or 10, !minor"),
    ("2.9", (10, 3), 91900, BF16, 128, True, "flash", "check_prefer_cudnn_attention 2.9: minor 0 only"),
    ("2.9", (9, 0), 90800, BF16, 128, True, "flash", "check_prefer_cudnn_attention 2.9: CUDNN_VERSION >= 90900"),
    ("2.8", (9, 0), 91900, BF16, 128, True, "flash", "priority_order 2.8: the default order, cuDNN after math"),
    ("2.13", (8, 9), 91900, BF16, 128, True, "flash", "check_prefer_cudnn_attention: majors 9 and 10 only"),
    ("2.13", (12, 0), 91900, BF16, 128, True, "flash", "check_prefer_cudnn_attention: sm120 is not preferred"),
    ("2.13", (9, 0), 91900, BF16, 256, True, "flash",
     "seqpar keeps cudnn to 128 (check_cudnn_tensor_shapes / check_cudnn_d256_bprop_head_dim: the docstring's (**))"),
    ("2.13", (9, 0), 91900, F16, 256, False, "flash", "as above, for eval too (the cuDNN frontend is not readable)"),
    ("2.13", (8, 6), None, BF16, 200, True, "efficient", "check_requires_grad_and_head_dim_gt192_..._sm86_89_or_120"),
    ("2.13", (8, 9), None, BF16, 224, True, "efficient", "check_requires_grad_and_head_dim_gt192_..._sm86_89_or_120"),
    ("2.13", (12, 0), None, BF16, 200, True, "efficient", "check_requires_grad_and_head_dim_gt192_..._or_120"),
    ("2.13", (12, 1), None, BF16, 200, True, "efficient", "..._gt192_..._or_120: sm121 in the gate from 2.8"),
    ("2.7", (12, 1), None, BF16, 200, True, "math", "check_flash/mem_efficient_hardware_support 2.7: up to sm120"),
    ("2.13", (8, 6), None, BF16, 200, False, "flash", "..._gt192_...: input_requires_grad only (eval runs flash)"),
    ("2.13", (8, 6), None, BF16, 232, True, "flash", "..._gt192_...: head_dim > 224 refused only with dropout"),
    ("2.13", (8, 0), None, BF16, 200, True, "flash", "..._gt192_...: not sm80 / sm90"),
    ("2.13", (7, 5), None, BF16, 128, True, "math", "less_than_sm80_mem_efficient_dtypes: half, float"),
    ("2.13", (7, 5), None, F16, 128, True, "efficient", "check_flash_attention_hardware_support: sm80+"),
    ("2.13", (7, 0), None, F32, 36, True, "efficient", "minimum_gemm_alignment: fp32 below sm80, no tensor cores: 1"),
    ("2.13", (9, 0), None, F32, 36, True, "efficient", "minimum_gemm_alignment: sm80+ fp32: 4"),
    ("2.13", (9, 0), None, BF16, 36, True, "math", "minimum_gemm_alignment: sm80+ half: 8 (and mha_fwd's % 8)"),
    ("2.13", (9, 0), None, BF16, 320, True, "efficient", "check_head_dim_size_flash: <= 256"),
    ("2.13", (9, 0), 91900, F32, 128, True, "efficient", "check_dtypes_low_precision: flash / cudnn half only"),
    ("2.13", (9, 0), 91900, F64, 128, True, "math", "no fused backend's dtype list has double"),
    ("2.13", (4, 0), None, F32, 128, True, "math", "check_mem_efficient_hardware_support: sm50+"),
    ("2.6", (10, 0), None, BF16, 128, True, "math", "check_*_hardware_support 2.6: up to sm90"),
    ("2.6", (9, 0), 91900, BF16, 128, True, "flash", "priority_order 2.6: the default order"),
]


@pytest.mark.parametrize("version,cap,cudnn,dtype,d,training,want,rule", ROUTES, ids=[r[7] for r in ROUTES])
def test_auto_routing_follows_torchs_rules(version, cap, cudnn, dtype, d, training, want, rule, sdpa_state):
    from seqpar.attention.sdpa_switches import SdpaSwitches

    set_switches()
    tv = tuple(int(x) for x in version.split("."))
    got = kernel_name_for("cuda", dtype, d, cap, cudnn, training=training, torch_version=tv,
                          switches=SdpaSwitches(cuda_major=12))
    assert got == want, rule
    if got != "math":
        assert kernel_problem(got, "cuda", dtype, d, cap, training=training, torch_version=tv) is None


def test_cuda13_builds_of_2_13_prefer_cudnn_on_every_minor():
    from seqpar.attention.sdpa_switches import SdpaSwitches

    for cuda, want in ((12, "flash"), (13, "cudnn")):  # check_prefer_cudnn_attention's CUDA_VERSION branch
        assert kernel_name_for("cuda", BF16, 128, (9, 4), 91900, torch_version=(2, 13),
                               switches=SdpaSwitches(cuda_major=cuda)) == want
    assert kernel_name_for("cuda", BF16, 128, (11, 0), 91900, torch_version=(2, 13),
                           switches=SdpaSwitches(cuda_major=13)) == "flash"  # majors 9 and 10 only


def test_the_issue_cases_follow_torchs_switches_read_at_call_time(sdpa_state, monkeypatch):
    """What a new user found: each switch was ignored. Every call below is the same; only torch's state changes."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")

    def h100(dtype=BF16, cap=(9, 0)):
        return kernel_name_for("cuda", dtype, 128, cap, 91900, torch_version=(2, 13))

    set_switches()
    assert h100() == "cudnn"
    torch.backends.cuda.enable_cudnn_sdp(False)
    assert h100() == "flash"
    set_switches(det="on")
    assert h100() == "flash"  # check_cudnn_deterministic
    set_switches(det="warn")
    assert h100() == "cudnn"  # warn_only: torch runs cuDNN and warns
    set_switches(flash=False)
    assert h100(cap=(8, 0)) == "efficient"
    set_switches(efficient=False)
    assert h100(F16, (7, 5)) == "math"
    set_switches()
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert h100() == "flash"
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                                         torch.nn.attention.SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert h100() == "efficient"  # the user's priority order (cuDNN and math switched off by the context)
    assert h100() == "cudnn"
    set_switches(flash=False, efficient=False, cudnn=False, math=False)
    with pytest.raises(SeqParError, match="no attention kernel can run.*enable_math_sdp"):
        h100()


def test_cpu_auto_follows_torchs_cpu_dispatcher(sdpa_state):
    assert {kernel_name_for("cpu", d) for d in (F16, BF16, F32, F64)} == {"cpu"}
    torch.backends.cuda.enable_flash_sdp(False)  # select_sdp_backend_cpp: the CPU flash kernel, then math
    assert kernel_name_for("cpu", F32) == "math"
    torch.backends.cuda.enable_math_sdp(False)
    with pytest.raises(SeqParError, match="no attention kernel"):
        kernel_name_for("cpu", F32)


def test_auto_routing_without_a_gpu_reading(sdpa_state):
    set_switches()
    # torch's CUDA flash op takes fp16/bf16 only: fp32 (the default) must go to the efficient op, fp64 to math.
    assert [kernel_name_for("cuda", d) for d in (F16, BF16, F32, F64)] == ["flash", "flash", "efficient", "math"]
    assert {kernel_name_for("mps", d) for d in (F16, F32)} == {"math"}


def test_cudnn_refused_before_torch_2_8_or_cudnn_9_and_old_torch_refused():
    assert "torch >= 2.8" in kernel_problem("cudnn", "cuda", BF16, 128, (9, 0), torch_version=(2, 7))
    assert kernel_problem("cudnn", "cuda", BF16, 128, (9, 0), torch_version=(2, 8)) is None
    # can_use_cudnn_attention: CUDNN_VERSION < 90000 is too old
    assert "needs cuDNN >= 9.0 (this torch has cuDNN 8.9.7)" in kernel_problem("cudnn", "cuda", BF16, 128, (9, 0),
                                                                               cudnn_version=8907)
    assert "this torch has no cuDNN" in kernel_problem("cudnn", "cuda", BF16, 128, (9, 0), cudnn_version=0)
    assert torch_rules((2, 20)) is torch_rules((2, 13))  # later releases: the last known rules
    with pytest.raises(SeqParError, match="torch >= 2.6"):
        torch_rules((2, 5))


def test_explicit_kernel_refuses_what_it_cannot_run(sdpa_state):
    from seqpar.attention.kernels import get_kernel

    cuda = torch.device("cuda")
    with pytest.raises(SeqParError, match="'flash' does not support torch.float32.*picks 'efficient'"):
        get_kernel(cuda, "cuda", torch.float32)  # 'cuda': the old name of 'flash'
    with pytest.raises(SeqParError, match="'efficient' does not support torch.float64.*'math'"):
        get_kernel(cuda, "cuda_efficient", torch.float64)
    with pytest.raises(SeqParError, match="'flash' needs head_dim a multiple of 8, got 12"):
        get_kernel(cuda, "flash", torch.bfloat16, head_dim=12)
    with pytest.raises(SeqParError, match="'cudnn' takes head_dim <= 128, got 256"):
        get_kernel(cuda, "cudnn", torch.bfloat16, head_dim=256)
    with pytest.raises(SeqParError, match="'flash' runs on cuda tensors, not cpu"):
        get_kernel(torch.device("cpu"), "flash", torch.bfloat16)
    with pytest.raises(SeqParError, match="unknown attention kernel 'fa9'"):
        get_kernel(cuda, "fa9", torch.bfloat16)
    assert get_kernel(cuda, "auto", torch.float64).name == "math"
    assert get_kernel(torch.device("cpu"), "auto", torch.float32).name == "cpu"


def test_explicit_kernel_honours_torchs_switches(sdpa_state):
    from seqpar.attention.kernels import get_kernel

    cuda = torch.device("cuda")
    set_switches(det="on")
    with pytest.raises(SeqParError, match="'cudnn' is not deterministic.*use_deterministic_algorithms"):
        get_kernel(cuda, "cudnn", torch.bfloat16, head_dim=64)
    set_switches(det="warn")
    assert get_kernel(cuda, "cudnn", torch.bfloat16, head_dim=64).name == "cudnn"
    set_switches(flash=False)
    with pytest.raises(SeqParError, match=r"'flash' is switched off \(torch.backends.cuda.enable_flash_sdp\(False\)"):
        get_kernel(cuda, "flash", torch.bfloat16, head_dim=64)
    with pytest.raises(SeqParError, match="'cpu' is switched off"):
        get_kernel(torch.device("cpu"), "cpu", torch.float32)
    set_switches(efficient=False, math=False)
    with pytest.raises(SeqParError, match="'efficient' is switched off"):
        get_kernel(cuda, "efficient", torch.float32)
    with pytest.raises(SeqParError, match="'math' is switched off.*no attention kernel can run"):
        get_kernel(cuda, "math", torch.float64)


def test_kernel_choice_line_names_the_flash_implementation_and_changed_switches(sdpa_state):
    from seqpar.attention.kernel_choice import describe_choice

    set_switches()
    line = describe_choice(torch.device("cuda"), "auto", torch.bfloat16, 128)
    assert line.startswith("attention kernel: flash (auto; cuda") and "flash implementation FA2" in line
    assert "SDPA switches" not in line
    assert "efficient (forced" in describe_choice(torch.device("cuda"), "efficient", torch.float32, 64)
    set_switches(flash=False)
    line = describe_choice(torch.device("cuda"), "auto", torch.bfloat16, 128)
    assert "attention kernel: efficient (auto" in line and "SDPA switches enabled: efficient, cudnn, math" in line
