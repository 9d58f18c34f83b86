"""Attention benchmark: communication bytes vs theory, causal load balance, and SP vs one-process time.

Three parts, all written to one JSON document (see `run`):

1. comm_bytes: bytes this rank hands to seqpar's collective wrappers (mesh.stats, per channel) for one
   attention call, forward and backward, for Ulysses / ring (zigzag) / USP on 4 gloo ranks, next to
   the byte formulas of seqpar.attention.costs evaluated with the ORIGINAL head counts and with the head counts that
   seqpar's Ulysses head plan actually moves (dummy q heads, replicated kv heads).
2. load_balance: causal attention FLOPs per ring rank from the ring's own piece plan (no run), for
   the contiguous and zigzag layouts and R in {2, 4, 8}; plus measured per-rank forward kernel CPU
   time at R=4 (a timing kernel wraps the CPU flash kernel, so only attention compute is counted).
3. timing: fwd+bwd wall and CPU time of SP (P=2, 1 thread per rank; seqpar Ulysses, ring, and
   DeepSpeed Ulysses when installed) vs torch SDPA and seqpar in one process (1 thread), interleaved
   in the same run so all see the same machine load; medians over repeats. Plus the kernel's own
   GFLOP/s next to a matmul's, and the CPU ratio a glue-free rival on the same kernel would reach
   (`kernel_bound.py`).

One module per part (comm.py, balance.py, timing.py: the rank code, the JSON section and its markdown table
side by side), the driver that spawns the worlds and assembles the document (driver.py), shared inputs
(inputs.py). The formulas live in `seqpar.attention.costs`, the optional DeepSpeed peer in `bench/peers.py`,
the PNG and the summary in `bench/plot.py`.
"""

from __future__ import annotations

from .comm import comm_cases
from .driver import Sizes, run

__all__ = ["Sizes", "comm_cases", "run"]
