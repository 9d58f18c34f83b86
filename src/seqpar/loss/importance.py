"""Importance sampling against a sampler whose log-probs differ from the trainer's (vLLM rollouts), as TRL's
GRPOTrainer `vllm_importance_sampling_correction`, exact under sequence parallelism.

Per row, d_t = old_t - sampling_t on completion tokens (0 elsewhere, and 0 where the sampler gave NaN: no
correction for a token it could not score, as TRL). The ratio is

    level "token":     r_t = exp(d_t)                       (each token its own)
    level "sequence":  r   = exp(sum over the row's completion tokens of d_t)  (every token of the row)

and the weight w on the policy term of each completion token (detached, before the KL) is

    mode "truncate":   w = clamp(r, clip_min, clip_max)     (None: that side unbounded)
    mode "mask":       w = r if clip_min <= r <= clip_max else 0

A row's sum spans SP ranks: it is all-reduced over the SP group WITHOUT gradient (the weight is detached), so each
rank's shard gets the full row's ratio. A row without completion tokens (padding, a completion truncated away) has
sum 0, ratio 1, and no token to weigh: no NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh

__all__ = ["IMPORTANCE_MODES", "ImportanceSampling", "importance_metrics", "importance_weight"]

# TRL's vllm_importance_sampling_mode values
IMPORTANCE_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class ImportanceSampling:
    """level "token" | "sequence", mode "truncate" | "mask", the ratio's bounds (None: unbounded on that side)."""

    level: str = "token"
    mode: str = "truncate"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence") or self.mode not in ("truncate", "mask"):
            raise SeqParError(f"importance sampling: level must be 'token' or 'sequence' and mode 'truncate' or "
                              f"'mask', got level={self.level!r} mode={self.mode!r}")
        lo, hi = self.clip_min, self.clip_max
        if (lo is not None and not lo >= 0) or (hi is not None and not hi > 0) or (
                lo is not None and hi is not None and lo > hi):
            raise SeqParError(f"importance sampling bounds need 0 <= clip_min <= clip_max, clip_max > 0 (None: "
                              f"unbounded), got clip_min={lo}, clip_max={hi}")

    @classmethod
    def from_name(cls, name: str, clip_min: float | None = None, clip_max: float | None = 3.0) -> ImportanceSampling:
        """From TRL's mode name ("token_truncate", ..., "sequence_mask")."""
        if name not in IMPORTANCE_MODES:
            raise SeqParError(f"importance sampling mode {name!r} is unknown: use one of {IMPORTANCE_MODES}")
        level, mode = name.split("_")
        return cls(level, mode, clip_min, clip_max)

    @property
    def name(self) -> str:
        return f"{self.level}_{self.mode}"


def importance_weight(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, spec: ImportanceSampling,
    mesh: SequenceParallelMesh | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [B, S_local] detached, 1 where not supervised; the completion tokens whose ratio fell outside the
    bounds: truncated or masked). old / sampling: this rank's [B, S_local] log-probs; mask: completion tokens."""
    if tuple(sampling.shape) != tuple(old.shape):
        raise SeqParError(f"sampling_logps must be [B, S_local] like logps {tuple(old.shape)}, "
                          f"got {tuple(sampling.shape)}")
    zero = torch.zeros_like(old)
    d = torch.where(mask, old.detach() - sampling.detach().to(old), zero)
    d = torch.nan_to_num(d, nan=0.0)  # a token the sampler could not score: no correction (TRL)
    if spec.level == "sequence":
        s = d.sum(1)
        if mesh is not None and mesh.sp_size > 1:  # the row's other tokens live on the other SP ranks
            s = comm.all_reduce_(s.clone().to(mesh.comm_device), mesh.sp_group, device=mesh.comm_device).to(d)
        d = s[:, None].expand_as(d)
    r = torch.exp(d)
    lo = -math.inf if spec.clip_min is None else spec.clip_min
    hi = math.inf if spec.clip_max is None else spec.clip_max
    outside = mask & ((r < lo) | (r > hi))
    w = torch.clamp(r, lo, hi) if spec.mode == "truncate" else torch.where(outside, zero, r)
    return torch.where(mask, w, torch.ones_like(w)), outside


def importance_metrics(w: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, level: str,
                       mesh: SequenceParallelMesh | None) -> dict[str, torch.Tensor]:
    """TRL's sampling/importance_sampling_ratio/min|mean|max of this micro-batch, over every rank: the token modes
    over completion tokens, the sequence modes over rows with a completion token (one w per row; TRL also counts
    a row whose completion is empty, at ratio 1). rows: [B, 2] per-row (completion tokens, sum of w), SP-reduced.
    No completion token anywhere: 0, as TRL."""
    inf = torch.tensor(float("inf"), dtype=w.dtype, device=w.device)
    ext = torch.stack([torch.where(mask, w, inf).min() if w.numel() else inf,
                       -(torch.where(mask, w, -inf).max() if w.numel() else -inf)])
    valid = rows[:, 0] > 0
    if level == "sequence":
        sums = torch.stack([(rows[:, 1] / rows[:, 0].clamp(min=1.0))[valid].sum(), valid.sum().to(w.dtype)])
    else:
        sums = torch.stack([rows[:, 1].sum(), rows[:, 0].sum()])
    if mesh is not None:
        groups = ((mesh.sp_group, mesh.sp_size), (mesh.dp_group, mesh.dp_size))
        for group, size in groups:  # the extremes over every shard; the sums over dp (rows are SP-reduced)
            if size > 1:
                ext = comm.all_reduce_(ext.clone().to(mesh.comm_device), group, dist.ReduceOp.MIN,
                                       device=mesh.comm_device).to(w)
        if mesh.dp_size > 1:
            sums = comm.all_reduce_(sums.clone().to(mesh.comm_device), mesh.dp_group,
                                    device=mesh.comm_device).to(w)
    ext = torch.where(torch.isinf(ext), torch.zeros_like(ext), ext)
    return {"sampling/importance_sampling_ratio/min": ext[0],
            "sampling/importance_sampling_ratio/mean": sums[0] / sums[1].clamp(min=1.0),
            "sampling/importance_sampling_ratio/max": -ext[1]}
