"""Optional peer for the attention benchmark: DeepSpeed's Ulysses `DistributedAttention` on gloo.

DeepSpeed is NOT a seqpar dependency: the benchmark uses it only when it is importable
(`pip install deepspeed`). Its bytes are counted by wrapping the all_to_all_single that its
sequence layer calls, with the same rule as seqpar's wrappers (bytes handed to the collective
minus this rank's own chunk).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["deepspeed_available", "setup_deepspeed", "DeepSpeedUlysses", "count_deepspeed_bytes"]


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def setup_deepspeed() -> str:
    """Attach DeepSpeed's comm layer to the already-initialised gloo process group; return its version."""
    import deepspeed
    import deepspeed.ops

    # On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op at init (minutes of C++ on this
    # machine, and a file lock that hangs other ranks). The Ulysses layer never uses it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed.__version__


class _LocalSdpa(torch.nn.Module):
    """DeepSpeed's local attention: [B, S, H/P, D] in, same out; causal, GQA-aware torch SDPA."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return o.transpose(1, 2)


class DeepSpeedUlysses:
    """seqpar-like call: (q, k, v) as [B, S/P, H, D] contiguous shards -> out [B, S/P, Hq, D]."""

    def __init__(self, group: Any, num_kv_heads: int) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        self.layer = DistributedAttention(_LocalSdpa(), group, scatter_idx=2, gather_idx=1, num_kv_heads=num_kv_heads)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.layer(q, k, v, 0)  # batch_dim_idx=0: batch-first inputs


@contextlib.contextmanager
def count_deepspeed_bytes(sent: list[int]) -> Iterator[None]:
    """Append the bytes this rank sends in every all_to_all_single of DeepSpeed's sequence layer."""
    import deepspeed.sequence.layer as layer

    orig = layer.dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        p, r = dist.get_world_size(group), dist.get_rank(group)
        total = input.numel() * input.element_size()
        if input_split_sizes:
            own = input_split_sizes[r] * (total // max(1, input.shape[0]))
        else:
            own = total // p
        sent.append(total - own)
        return orig(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
        )

    layer.dist.all_to_all_single = counting
    try:
        yield
    finally:
        layer.dist.all_to_all_single = orig
