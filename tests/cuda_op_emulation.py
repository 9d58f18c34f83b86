"""float64 CPU emulations of torch's CUDA attention ops, for `CudaOpSpy(emulate=True)` (tests/cuda_op_spy.py).

Each function takes the op's arguments (bound by name from its schema) and returns what the real CUDA op returns,
in its layouts, computed in float64 from exactly the arguments it is given:
- forwards: out = softmax(q k^T * scale) v and the log-sum-exp, in the op's lse layout (flash dense [B, H, Sq];
  flash varlen [H, T]; memory-efficient [B, H, ceil(Sq / 32) * 32], padded rows +inf; cuDNN [B, H, Sq, 1]), out
  laid out in memory as the op allocates it ([B, S, H, D] rows; cuDNN: in q's dimension order);
- backwards: from the out / lse ARGUMENTS, as the fused kernels do (they never recompute them): P = exp(S - lse),
  Delta = rowsum(dout * out), dS = P * (dP - Delta); dK / dV summed over each KV head's q heads (GQA as the op
  takes it: natively for flash / cuDNN, equal heads for the memory-efficient op).
So a ring step's backward, called with the ring's MERGED out / lse, gets the true gradient of that piece, and a
shortcut around an op that does not use the same arguments shows up as a wrong gradient.

What the real ops refuse is refused here too (SeqParTestRefusal): is_causal with Sq != Sk where the op's
alignment differs from seqpar's top-left rule (the flash ops align the diagonal bottom-right), cuDNN's single-key
call (s_q = s_kv = 1), dropout. The argument rules (dtypes, strides, lse layouts, philox tensors) are the spy's.
"""

from __future__ import annotations

import math

import torch

__all__ = ["EMULATIONS", "EmulatedOpRefused"]

aten = torch.ops.aten
_LSE_ALIGN = 32


class EmulatedOpRefused(AssertionError):
    """The real CUDA op would refuse (or silently mis-align) this call."""


def _scale(scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _window_mask(sq: int, sk: int, left, right) -> torch.Tensor:
    """FlashAttention's local window (bottom-right aligned): q row i sees keys i + sk - sq - left .. i + sk - sq +
    right (None / negative: unbounded on that side)."""
    d = torch.arange(sk)[None, :] - (torch.arange(sq)[:, None] + sk - sq)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None and left >= 0:
        ok &= d >= -left
    if right is not None and right >= 0:
        ok &= d <= right
    return ok


def _scores(q, k, causal: bool, scale: float, op: str, align_any: bool, window=None):
    """q [B, H, Sq, D], k [B, Hk, Sk, D] (float64) -> scores [B, H, Sq, Sk] with the causal mask (top-left) and a
    FlashAttention window (left, right) if given."""
    g = q.shape[1] // k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    if window is not None:
        ok = _window_mask(sq, sk, *window)
        if not ok.any(-1).all():
            raise EmulatedOpRefused(f"{op}: window {window} leaves a query row without keys")
        s = s.masked_fill(~ok, float("-inf"))
    if causal:
        if sq != sk and not align_any:
            raise EmulatedOpRefused(f"{op}: is_causal with Sq {sq} != Sk {sk}: this op aligns the diagonal "
                                    "bottom-right, seqpar assumes top-left")
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    return s, g


def _fwd(q, k, v, causal, scale, op, align_any=False, window=None):
    """float64 (out [B, H, Sq, D], lse [B, H, Sq]) of [B, H, S, D] inputs."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    s, g = _scores(q64, k64, causal, _scale(scale, q.shape[-1]), op, align_any, window)
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v64.repeat_interleave(g, 1))
    return out, lse


def _fold(x, hk: int):
    b, h, s, d = x.shape
    return x.view(b, hk, h // hk, s, d).sum(2)


def _bwd(dout, q, k, v, out, lse, causal, scale, op, align_any=False, window=None):
    """float64 (dq, dk, dv) from the given out / lse ([B, H, S, D] / [B, H, Sq])."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    sc = _scale(scale, q.shape[-1])
    s, g = _scores(q64, k64, causal, sc, op, align_any, window)
    p = torch.exp(s - lse.double()[..., None])
    do = dout.double()
    dv = _fold(torch.matmul(p.transpose(-1, -2), do), k.shape[1])
    dp = torch.matmul(do, v64.repeat_interleave(g, 1).transpose(-1, -2))
    delta = (do * out.double()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * sc
    dq = torch.matmul(ds, k64.repeat_interleave(g, 1))
    dk = _fold(torch.matmul(ds.transpose(-1, -2), q64), k.shape[1])
    return dq, dk, dv


def _rows_layout(x64, dtype):
    """[B, H, S, D] values laid out as [B, S, H, D] rows in memory (how the ops allocate their output)."""
    return x64.transpose(1, 2).contiguous().transpose(1, 2).to(dtype)


def _like(x64, ref):
    """x64 in ref's dtype with ref's strides (gradients come back laid out like their inputs)."""
    return torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype).copy_(x64)


def _philox():
    return torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)


def _no_dropout(a, op):
    if a.get("dropout_p"):
        raise EmulatedOpRefused(f"{op}: dropout is not emulated (seqpar never uses it)")


# ---------------------------------------------------------------------------------------------------- flash
def flash_fwd(a):
    _no_dropout(a, "flash")
    q = a["query"]
    out, lse = _fwd(q, a["key"], a["value"], a["is_causal"], a["scale"], "flash")
    seed, offset = _philox()
    return (_rows_layout(out, q.dtype), lse.float().contiguous(), None, None, q.shape[2], a["key"].shape[2], seed,
            offset, torch.empty(0, dtype=q.dtype))


def flash_bwd(a):
    q, k, v = a["query"], a["key"], a["value"]
    g = _bwd(a["grad_out"], q, k, v, a["out"], a["logsumexp"], a["is_causal"], a["scale"], "flash")
    return tuple(_like(x, ref) for x, ref in zip(g, (q, k, v)))


def _segments(cu):
    c = [int(x) for x in cu.tolist()]
    return list(zip(c[:-1], c[1:]))


def _varlen(a, fn):
    """Run fn(i, q_rows, k_rows) per sequence of a varlen call ([T, H, D] rows, int32 cum_seq)."""
    qs, ks = _segments(a["cum_seq_q"]), _segments(a["cum_seq_k"])
    if len(qs) != len(ks):
        raise EmulatedOpRefused("varlen: cum_seq_q and cum_seq_k describe different numbers of sequences")
    for i, ((q0, q1), (k0, k1)) in enumerate(zip(qs, ks)):
        if q1 - q0 > a["max_q"] or k1 - k0 > a["max_k"]:
            raise EmulatedOpRefused(f"varlen: sequence {i} is longer than max_q {a['max_q']} / max_k {a['max_k']}")
        fn(slice(q0, q1), slice(k0, k1))


def _bhsd(x, rows):
    return x[rows].transpose(0, 1)[None]  # [T, H, D] rows -> [1, H, S, D]


def _window_args(a):
    left, right = a.get("window_size_left"), a.get("window_size_right")
    return None if left is None and right is None else (left, right)


def varlen_fwd(a):
    _no_dropout(a, "flash varlen")
    if a["cum_seq_q"] is None:
        raise EmulatedOpRefused("_flash_attention_forward without cum_seq: seqpar calls it for varlen only")
    q, k, v = a["query"], a["key"], a["value"]
    out = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)

    def one(sq, sk):
        o, l_ = _fwd(_bhsd(q, sq), _bhsd(k, sk), _bhsd(v, sk), a["is_causal"], a["scale"], "flash varlen",
                     window=_window_args(a))
        out[sq], lse[sq] = o[0].transpose(0, 1), l_[0].transpose(0, 1)

    _varlen(a, one)
    seed, offset = _philox()
    return out.to(q.dtype), lse.t().float().contiguous(), seed, offset, torch.empty(0, dtype=q.dtype)


def varlen_bwd(a):
    q, k, v = a["query"], a["key"], a["value"]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    lse = a["logsumexp"].t()  # [H, T] -> [T, H]

    def one(sq, sk):
        g = _bwd(_bhsd(a["grad_out"], sq), _bhsd(q, sq), _bhsd(k, sk), _bhsd(v, sk), _bhsd(a["out"], sq),
                 lse[sq].t()[None], a["is_causal"], a["scale"], "flash varlen", window=_window_args(a))
        dq[sq] += g[0][0].transpose(0, 1)
        dk[sk] += g[1][0].transpose(0, 1)
        dv[sk] += g[2][0].transpose(0, 1)

    _varlen(a, one)
    return tuple(_like(x, ref) for x, ref in zip((dq, dk, dv), (q, k, v)))


# ---------------------------------------------------------------------------------------------------- efficient
def efficient_fwd(a):
    _no_dropout(a, "efficient")
    q = a["query"]
    out, lse = _fwd(q, a["key"], a["value"], a["is_causal"], a["scale"], "efficient", align_any=True)
    pad = -q.shape[2] % _LSE_ALIGN
    lse = torch.nn.functional.pad(lse, (0, pad), value=float("inf"))
    seed, offset = _philox()
    return _rows_layout(out, q.dtype), lse.float().contiguous(), seed, offset


def efficient_bwd(a):
    q, k, v = a["query"], a["key"], a["value"]
    lse = a["logsumexp"][..., : q.shape[2]]
    g = _bwd(a["grad_out_"], q, k, v, a["out"], lse, a["is_causal"], a["scale"], "efficient", align_any=True)
    return (*(_like(x, ref) for x, ref in zip(g, (q, k, v))), None)


# ---------------------------------------------------------------------------------------------------- cudnn
def _q_order(x64, q):
    """x64 ([B, H, S, D]) laid out in memory in q's dimension order (how cuDNN's forward allocates out)."""
    order = sorted(range(4), key=lambda i: -q.stride(i))
    return x64.permute(order).contiguous().permute([order.index(i) for i in range(4)]).to(q.dtype)


def cudnn_fwd(a):
    _no_dropout(a, "cudnn")
    q, k = a["query"], a["key"]
    if q.shape[2] == 1 and k.shape[2] == 1:
        raise EmulatedOpRefused("cudnn: s_q = s_kv = 1 is not supported (cuDNN Frontend error)")
    out, lse = _fwd(q, k, a["value"], a["is_causal"], a["scale"], "cudnn", align_any=True)
    seed, offset = _philox()
    return (_q_order(out, q), lse.float()[..., None].contiguous(), None, None, q.shape[2], k.shape[2], seed, offset,
            None)


def cudnn_bwd(a):
    q, k, v = a["query"], a["key"], a["value"]
    if q.shape[2] == 1 and k.shape[2] == 1:
        raise EmulatedOpRefused("cudnn backward: s_q = s_kv = 1 is not supported (cuDNN Frontend error)")
    g = _bwd(a["grad_out"], q, k, v, a["out"], a["logsumexp"][..., 0], a["is_causal"], a["scale"], "cudnn",
             align_any=True)
    return tuple(_like(x, ref) for x, ref in zip(g, (q, k, v)))


EMULATIONS = {
    aten._scaled_dot_product_flash_attention.default: flash_fwd,
    aten._scaled_dot_product_flash_attention_backward.default: flash_bwd,
    aten._flash_attention_forward.default: varlen_fwd,
    aten._flash_attention_backward.default: varlen_bwd,
    aten._scaled_dot_product_efficient_attention.default: efficient_fwd,
    aten._scaled_dot_product_efficient_attention_backward.default: efficient_bwd,
    aten._scaled_dot_product_cudnn_attention.default: cudnn_fwd,
    aten._scaled_dot_product_cudnn_attention_backward.default: cudnn_bwd,
}
