"""The gated delta rule (Gated DeltaNet) on one piece, with what state passing needs.

Per v head, with unit-normalised k_t (and q_t scaled by 1/sqrt(dk)), state S [dk, dv]:
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t.
So S_t = P_t S_0 + (the state from S_0 = 0), with P_t = A_t ... A_1 and A_t = exp(g_t)(I - beta_t k_t k_t^T):
the outgoing state is M S_0 + b with M = P_L, and o_t(S_0) = o_t(0) + (q_t^T P_t) S_0.

The value columns of the recurrence are independent (A_t does not depend on v), so ONE call of the model's own
kernel gives everything: values [v | 0] (dv + dk columns) from the initial state [0 | I]. The first dv columns
are the piece on its own (o(0), b); the last dk give, in the final state, P_L = M and, in the output, the rows
q_t^T P_t that map an incoming state to the output's correction. The kernel (transformers'
`torch_chunk_gated_delta_rule`, or a hub kernel with the same signature) is used as is; a piece that starts a
document (or the sequence) runs without the extra columns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .engine import PieceResult

__all__ = ["delta_piece"]


def delta_piece(rule: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, carries: bool) -> PieceResult:
    """q, k [b, L, hk, dk]; v [b, L, hv, dv]; g, beta [b, L, hv] (g fp32 log-decay). `rule` is called as
    rule(q, k, v, g=, beta=, initial_state=, output_final_state=True, use_qk_l2norm_in_kernel=True)."""
    kw = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if not carries:
        out, final = rule(q, k, v, initial_state=None, **kw)
        return PieceResult(out, final)
    b, n, hv, dv = v.shape
    dk = k.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(b, n, hv, dk)], dim=-1)
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    eye = torch.eye(dk, dtype=acc, device=v.device).expand(b, hv, dk, dk)
    init = torch.cat([torch.zeros(b, hv, dk, dv, dtype=acc, device=v.device), eye], dim=-1)
    out_aug, final_aug = rule(q, k, v_aug, initial_state=init, **kw)
    out, rows = out_aug[..., :dv], out_aug[..., dv:]  # rows: q_t^T P_t  [b, L, hv, dk]
    final, through = final_aug[..., :dv], final_aug[..., dv:]  # b [b, hv, dk, dv]; M = P_L [b, hv, dk, dk]

    def correct(s_in: torch.Tensor) -> torch.Tensor:
        return torch.einsum("blhk,bhkv->blhv", rows.to(s_in.dtype), s_in)

    return PieceResult(out, final, through, correct)
