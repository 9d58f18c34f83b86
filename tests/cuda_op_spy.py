"""A dispatch spy that checks every call of torch's CUDA attention ops against what the real CUDA op requires.

torch's meta implementations of these ops only allocate outputs: they check no dtype, no int32 cum_seq, no
head dim, no stride, no lse layout. So a call that crashes (or, worse, silently computes wrong gradients) on
a GPU passes on the meta device. `CudaOpSpy` (a TorchDispatchMode) closes that gap for CI: every call of a
CUDA attention op is bound to its schema and checked against the rules below, then run on the meta device.

The rules come from torch's CUDA sources (aten/src/ATen/native/transformers/cuda/attention.cu,
attention_backward.cu, flash_attn/flash_api.cpp: mha_fwd / mha_varlen_fwd / mha_bwd / mha_varlen_bwd,
mem_eff_attention/kernel_forward.h / kernel_backward.h, cudnn/MHA.cpp) and were checked one by one on an
H200 with torch 2.11.0+cu130 (wrong calls fail there, or give wrong gradients silently where marked SILENT):

flash, dense (_scaled_dot_product_flash_attention / _backward; q/k/v [B, H, S, D]):
  F1 q, k, v (and out, grad_out in backward) fp16 or bf16, one dtype       (mha_fwd / mha_bwd dtype checks)
  F2 q, k, v unit stride along head_dim                                     ("contiguous last dimension")
  F3 head_dim a multiple of 8 and <= 256; v's head_dim == q's               (mha_fwd shape checks)
  F4 q heads a multiple of k heads; k and v the same shape                  (GQA: H % Hk == 0)
  F5 backward: cum_seq_q / cum_seq_k undefined (None): a defined one selects the varlen path, which demands
     int32 ("cu_seqlens_q must have dtype int32": the crash of every bf16 step before)
  F6 backward: logsumexp fp32, contiguous, [B, H, Sq]                      (SILENT: mha_bwd does not check it)
  F7 backward: philox seed/offset are the tensors a flash forward returned  (what torch's autograd passes)
flash, varlen (_flash_attention_forward / _backward with cum_seq; q [T, H, D], k/v [Tk, Hk, D]):
  V1 cum_seq_q / cum_seq_k both given, int32, 1-D, contiguous, on q's device, the same length >= 2
  V2 F1-F4 on the 3-D rows
  V3 backward: logsumexp fp32, contiguous, [H, T]                          (SILENT: not shape-checked)
  V4 backward: rng_state / unused are the tensors a varlen forward returned
efficient (_scaled_dot_product_efficient_attention / _backward):
  E1 fp32, fp16 or bf16, one dtype; q, k, v the same head count (no GQA); attn_bias None (seqpar never masks)
  E2 unit stride along head_dim; the other strides multiples of 8 elements (4 in fp32) ("not correctly aligned")
  E3 head_dim a multiple of 8 (4 in fp32)
  E4 forward: compute_log_sumexp True (seqpar merges on it)
  E5 backward: out in the forward's layout, [B, S, H, D] rows in memory (SILENT: out.contiguous() in [B, H, S, D]
     gave wrong gradients): stride over S == H * D, over H == D
  E6 backward: logsumexp fp32 [B, H, >= Sq] with strides over B and H multiples of 8 (padded to 32 rows)
  E7 backward: philox seed/offset are the tensors an efficient forward returned
cudnn (_scaled_dot_product_cudnn_attention / _backward):
  C1 fp16 or bf16; unit stride along head_dim; head_dim a multiple of 8, <= 128 (256 on sm90 with new cuDNN);
     more than one key ("cuDNN Frontend error: s_q = s_kv = 1 is not supported", in backward, H200 / 2.11) and
     more than one query (refused before torch 2.9)
  C2 forward: compute_log_sumexp True, attn_bias None
  C3 backward: logsumexp defined, fp32 [B, H, Sq, 1]; cum_seq undefined (dense)
  C4 backward: grad_out with exactly out's strides, and out in the layout the forward allocates for q (q's
     dimension order) (SILENT otherwise in 2.11: wrong dq)
  C5 backward: philox seed/offset are the tensors a cudnn forward returned (they must be CUDA tensors)
Every op: tensors on the CUDA device (here: meta, which stands for it).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


class CudaRuleViolation(AssertionError):
    pass


def _bind(func, args, kwargs) -> dict:
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _device(errs, *ts, cpu_ok: bool = False):
    allowed = ("cuda", "meta", "cpu") if cpu_ok else ("cuda", "meta")
    for t in ts:
        if isinstance(t, torch.Tensor) and t.device.type not in allowed:
            errs.append(f"a {t.device.type} tensor where the op needs CUDA tensors")


def _qkv_common(errs, q, k, v, dtypes, gqa: bool, max_d: int | None, mult: int):
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        errs.append(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: need one of {dtypes}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            errs.append(f"{name} head_dim stride {t.stride(-1)} (needs 1)")
    d = q.shape[-1]
    if d % mult or (max_d is not None and d > max_d) or v.shape[-1] != d or k.shape[-1] != d:
        errs.append(f"head_dim q {d} k {k.shape[-1]} v {v.shape[-1]}: needs equal, a multiple of {mult}"
                    + (f", <= {max_d}" if max_d else ""))
    hq, hk = q.shape[-3] if q.dim() == 4 else q.shape[-2], k.shape[-3] if k.dim() == 4 else k.shape[-2]
    if (gqa and hq % hk) or (not gqa and hq != hk) or k.shape != v.shape:
        errs.append(f"heads q {hq} k {hk} (k {tuple(k.shape)} v {tuple(v.shape)}): "
                    + ("q heads a multiple of k heads" if gqa else "equal head counts (no GQA)"))


class CudaOpSpy(TorchDispatchMode):
    """Checks every CUDA attention op call (rules in the module docstring) and counts launches per op.

    emulate=True: the calls take CPU tensors and return the float64 emulation of the op (tests/cuda_op_emulation.py)
    instead of running torch's meta implementation: the same argument checks, plus the numbers the real op would
    give, so the logic between the calls (merges, shortcuts, layouts, every SP mode) is checked numerically on CPU.
    precise=True (with emulate): fp32 / fp64 inputs pass the fused ops' dtype rule, so that logic is checked at fp32
    tolerances; every other rule still applies."""

    def __init__(self, emulate: bool = False, precise: bool = False):
        super().__init__()
        self.emulate = emulate
        self.half = (*_HALF, torch.float32, torch.float64) if precise else _HALF
        self.launches: Counter[str] = Counter()
        self._aux: dict[str, set[int]] = {"flash": set(), "varlen": set(), "efficient": set(), "cudnn": set()}
        self._keep: list = []  # keep returned aux tensors alive so their ids stay unique
        self.checks = {
            aten._scaled_dot_product_flash_attention.default: self._flash_fwd,
            aten._scaled_dot_product_flash_attention_backward.default: self._flash_bwd,
            aten._flash_attention_forward.default: self._varlen_fwd,
            aten._flash_attention_backward.default: self._varlen_bwd,
            aten._scaled_dot_product_efficient_attention.default: self._eff_fwd,
            aten._scaled_dot_product_efficient_attention_backward.default: self._eff_bwd,
            aten._scaled_dot_product_cudnn_attention.default: self._cudnn_fwd,
            aten._scaled_dot_product_cudnn_attention_backward.default: self._cudnn_bwd,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = self.checks.get(func)
        if check is None:
            return func(*args, **kwargs)
        a = _bind(func, args, kwargs)
        errs: list[str] = []
        _device(errs, *[x for x in a.values() if isinstance(x, torch.Tensor)], cpu_ok=self.emulate)
        check(a, errs)
        if errs:
            raise CudaRuleViolation(f"{func.name()}: " + "; ".join(errs))
        self.launches[func.name().split("::")[1]] += 1
        if self.emulate:
            from cuda_op_emulation import EMULATIONS

            res = EMULATIONS[func](a)
        else:
            res = func(*args, **kwargs)
        self._record(func, res)
        return res

    def _record(self, func, res):
        idx = {aten._scaled_dot_product_flash_attention.default: ("flash", (6, 7)),
               aten._flash_attention_forward.default: ("varlen", (2, 3)),
               aten._scaled_dot_product_efficient_attention.default: ("efficient", (2, 3)),
               aten._scaled_dot_product_cudnn_attention.default: ("cudnn", (6, 7))}.get(func)
        if idx is not None:
            for i in idx[1]:
                self._aux[idx[0]].add(id(res[i]))
                self._keep.append(res[i])

    def _from_forward(self, errs, kind, *ts):
        if any(id(t) not in self._aux[kind] for t in ts):
            errs.append(f"philox seed/offset are not the tensors a {kind} forward returned")

    # ------------------------------------------------------------------ flash
    def _flash_fwd(self, a, errs):
        _qkv_common(errs, a["query"], a["key"], a["value"], self.half, True, 256, 8)
        if a["return_debug_mask"] and not a["dropout_p"]:
            errs.append("return_debug_mask needs dropout_p > 0")

    def _flash_bwd(self, a, errs):
        q = a["query"]
        _qkv_common(errs, q, a["key"], a["value"], self.half, True, 256, 8)
        for name in ("grad_out", "out"):
            if a[name].dtype != q.dtype or a[name].shape != q.shape:
                errs.append(f"{name} {a[name].dtype} {tuple(a[name].shape)} vs q {q.dtype} {tuple(q.shape)}")
        for name in ("cum_seq_q", "cum_seq_k"):
            if a[name] is not None:
                errs.append(f"{name} is defined ({a[name].dtype}): dense calls pass the forward's None (a defined "
                            "one selects the varlen path, which needs int32)")
        lse = a["logsumexp"]
        if lse.dtype != torch.float32 or not lse.is_contiguous() or tuple(lse.shape) != tuple(q.shape[:3]):
            errs.append(f"logsumexp {lse.dtype} {tuple(lse.shape)} contiguous={lse.is_contiguous()}: needs fp32, "
                        f"contiguous {tuple(q.shape[:3])}")
        self._from_forward(errs, "flash", a["philox_seed"], a["philox_offset"])

    def _cu(self, a, errs, n_q, n_k):
        cq, ck = a["cum_seq_q"], a["cum_seq_k"]
        if cq is None or ck is None:
            errs.append("varlen needs both cum_seq_q and cum_seq_k")
            return
        for name, t in (("cum_seq_q", cq), ("cum_seq_k", ck)):
            if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.numel() < 2:
                errs.append(f"{name} {t.dtype} {tuple(t.shape)}: needs int32, 1-D, contiguous, >= 2 entries")
        if cq.numel() != ck.numel():
            errs.append(f"cum_seq lengths {cq.numel()} != {ck.numel()}")
        if a["query"].dim() != 3 or a["key"].dim() != 3:
            errs.append("varlen q/k/v must be [total, heads, head_dim]")

    def _varlen_fwd(self, a, errs):
        self._cu(a, errs, None, None)
        _qkv_common(errs, a["query"], a["key"], a["value"], self.half, True, 256, 8)
        if a["return_debug_mask"] and not a["dropout_p"]:
            errs.append("return_debug_mask needs dropout_p > 0")

    def _varlen_bwd(self, a, errs):
        self._cu(a, errs, None, None)
        q = a["query"]
        _qkv_common(errs, q, a["key"], a["value"], self.half, True, 256, 8)
        for name in ("grad_out", "out"):
            if a[name].dtype != q.dtype or a[name].shape != q.shape:
                errs.append(f"{name} {a[name].dtype} {tuple(a[name].shape)} vs q {q.dtype} {tuple(q.shape)}")
        lse = a["logsumexp"]
        want = (q.shape[1], q.shape[0])
        if lse.dtype != torch.float32 or not lse.is_contiguous() or tuple(lse.shape) != want:
            errs.append(f"logsumexp {lse.dtype} {tuple(lse.shape)}: needs fp32, contiguous {want} ([H, total])")
        self._from_forward(errs, "varlen", a["rng_state"], a["unused"])

    # ------------------------------------------------------------------ efficient
    def _eff_common(self, a, errs):
        q, k, v = a["query"], a["key"], a["value"]
        mult = 4 if q.dtype == torch.float32 else 8
        _qkv_common(errs, q, k, v, (torch.float32, *self.half), False, None, mult)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if any(t.stride(i) % mult for i in range(3) if t.shape[i] > 1):
                errs.append(f"{name} strides {t.stride()} not multiples of {mult} elements")
        if a["attn_bias"] is not None:
            errs.append("attn_bias given (seqpar never masks with a bias)")

    def _eff_fwd(self, a, errs):
        self._eff_common(a, errs)
        if not a["compute_log_sumexp"]:
            errs.append("compute_log_sumexp=False: no lse to merge")

    def _eff_bwd(self, a, errs):
        self._eff_common(a, errs)
        out, lse = a["out"], a["logsumexp"]
        b, h, s, d = out.shape
        if (s > 1 and out.stride(2) != h * d) or (h > 1 and out.stride(1) != d):
            errs.append(f"out strides {out.stride()}: the forward's layout has [B, S, H, D] rows (stride over S "
                        f"{h * d}, over H {d})")
        if lse.dtype != torch.float32 or lse.dim() != 3 or tuple(lse.shape[:2]) != (b, h) or lse.shape[2] < s \
                or (h > 1 and lse.stride(1) % 8) or (b > 1 and lse.stride(0) % 8):
            errs.append(f"logsumexp {lse.dtype} {tuple(lse.shape)} strides {lse.stride()}: needs fp32 [B, H, >= Sq] "
                        "with strides over B and H multiples of 8")
        self._from_forward(errs, "efficient", a["philox_seed"], a["philox_offset"])

    # ------------------------------------------------------------------ cudnn
    def _cudnn_common(self, a, errs):
        _qkv_common(errs, a["query"], a["key"], a["value"], self.half, True, 256, 8)
        if a["query"].shape[-1] > 128:
            errs.append("head_dim > 128 needs sm90 with cuDNN >= 9.10 (seqpar refuses it)")
        if a["key"].shape[2] == 1:
            errs.append("one key: cuDNN refuses s_q = s_kv = 1 (s_kv = 1 on every torch: check_cudnn_tensor_shapes)")
        if a["query"].shape[2] == 1:
            errs.append("one query: cuDNN refuses s_q = 1 before torch 2.9 (check_cudnn_tensor_shapes)")
        if a["attn_bias"] is not None:
            errs.append("attn_bias given (seqpar never masks with a bias)")

    def _cudnn_fwd(self, a, errs):
        self._cudnn_common(a, errs)
        if not a["compute_log_sumexp"]:
            errs.append("compute_log_sumexp=False: the lse comes back undefined")

    def _cudnn_bwd(self, a, errs):
        self._cudnn_common(a, errs)
        q, out, do, lse = a["query"], a["out"], a["grad_out"], a["logsumexp"]
        if lse is None or lse.dtype != torch.float32 or tuple(lse.shape) != (*q.shape[:3], 1):
            errs.append(f"logsumexp {None if lse is None else (lse.dtype, tuple(lse.shape))}: needs fp32 "
                        f"{(*q.shape[:3], 1)}")
        if a["cum_seq_q"] is not None or a["cum_seq_k"] is not None:
            errs.append("cum_seq defined: dense calls pass None")
        if do.stride() != out.stride():
            errs.append(f"grad_out strides {do.stride()} != out strides {out.stride()}")
        if _dim_order(out) != _dim_order(q):
            errs.append(f"out strides {out.stride()} not in q's layout {q.stride()} (the forward allocates out so)")
        self._from_forward(errs, "cudnn", a["philox_seed"], a["philox_offset"])


def _dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """The order of t's non-singleton dims from outermost to innermost stride."""
    dims = [i for i in range(t.dim()) if t.shape[i] > 1]
    return tuple(sorted(dims, key=lambda i: -t.stride(i)))
