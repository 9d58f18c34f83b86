"""What one attention layer attends to (its span: the whole causal prefix, a sliding window, a chunk), read from a
config, and the work a span leaves: visible (query, key) pairs, per ring rank, with the ring steps that do any.

Spans (transformers' masks, `masking_utils`): "full": key j is visible to query i when j <= i; "sliding" window w:
also i - j < w (a query sees min(i + 1, w) keys; Gemma 2/3, Mistral, Qwen2's max_window_layers, Cohere2, gpt-oss);
"chunked" chunk c (Llama 4's attention_chunk_size): also i // c == j // c (causal inside each chunk).

The ring (seqpar.attention.ring, its plan seqpar.attention.pieces.plan_pieces with `window`, chunks as document
boundaries) skips the compute of a (q block, kv block) pair with no visible pair and computes only the pairs in reach
inside the others, so a windowed layer's work grows as S_local x w, not S_local x S. `visible_pairs` counts those
pairs in closed form (O(1) per block pair: the planner evaluates many lengths; the piece plan's own count loops over
rows), and tests check it equals the plan's count pair for pair. The ring still rotates every K/V block around the
whole ring: its traffic is priced as a full-attention layer's (planner.collectives).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..attention.pieces import plan_pieces
from ..errors import SeqParError
from ..layout import ring_segments

__all__ = ["Span", "FULL", "layer_spans", "visible_pairs", "span_pairs_per_rank", "steps_with_work",
           "span_rows_factor", "span_groups", "engine_args"]


@dataclass(frozen=True)
class Span:
    kind: str = "full"  # "full" | "sliding" | "chunked"
    size: int = 0  # the window (sliding) or the chunk length (chunked); 0 for full

    def describe(self) -> str:
        return {"full": "global", "sliding": f"sliding window {self.size}",
                "chunked": f"chunked attention {self.size}"}[self.kind]


FULL = Span()


def layer_spans(hf: Any, layers: int) -> tuple[Span, ...]:
    """Each layer's span from a transformers config object (its derived `layer_types` included: Gemma's pattern,
    Qwen2's use_sliding_window / max_window_layers); a window without layer_types (Mistral) slides in every layer."""
    window, chunk = getattr(hf, "sliding_window", None), getattr(hf, "attention_chunk_size", None)
    types = getattr(hf, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * layers
    out = []
    for t in [str(t) for t in types][:layers]:
        if "sliding" in t and window is not None:
            out.append(Span("sliding", _positive(window, "sliding_window")))
        elif t == "chunked_attention" and chunk is not None:
            out.append(Span("chunked", _positive(chunk, "attention_chunk_size")))
        else:  # full attention, or a layer that is no attention at all (recurrent, MLP blocks: never read)
            out.append(FULL)
    return tuple(out)


def _positive(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SeqParError(f"config.{what}={v!r}: give a positive whole number of tokens")
    return v


def span_groups(spans: tuple[Span, ...], attention: list[int]) -> Counter[Span]:
    """How many of the attention layers (their indices) have each span."""
    return Counter(spans[i] if i < len(spans) else FULL for i in attention)


def _prefix(t: int, n: int) -> int:
    """sum of min(max(x, 0), n) for x in [0, t)."""
    if t <= 0:
        return 0
    if t <= n + 1:
        return t * (t - 1) // 2
    return n * (n + 1) // 2 + (t - n - 1) * n


def _pairs_at_least(q0: int, q1: int, k0: int, k1: int, d: int) -> int:
    """#{(i, j): i in [q0, q1), j in [k0, k1), i - j >= d}: for each query, the keys j <= i - d."""
    n, c = k1 - k0, d + k0 - 1  # query i sees clamp(i - c, 0, n) such keys
    if n <= 0 or q1 <= q0:
        return 0
    return _prefix(q1 - c, n) - _prefix(q0 - c, n)


def visible_pairs(q0: int, q1: int, k0: int, k1: int, span: Span = FULL) -> int:
    """Visible (query, key) pairs between the global positions [q0, q1) and [k0, k1) under `span`."""
    if span.kind == "sliding":
        return _pairs_at_least(q0, q1, k0, k1, 0) - _pairs_at_least(q0, q1, k0, k1, span.size)
    if span.kind == "chunked":
        c, total = span.size, 0
        for start in range(max(q0, k0) // c * c, min(q1, k1), c):  # the chunks holding both queries and keys
            total += _pairs_at_least(max(q0, start), min(q1, start + c), max(k0, start), min(k1, start + c), 0)
        return total
    return _pairs_at_least(q0, q1, k0, k1, 0)


@functools.lru_cache(maxsize=256)
def _pair_matrix(seq: int, ring: int, layout: str, span: Span) -> tuple[tuple[int, ...], ...]:
    """[me][j]: visible pairs between ring rank me's queries and ring rank j's keys (ring_segments' layout)."""
    segs = [ring_segments(seq, ring, r, layout) for r in range(ring)]
    return tuple(tuple(sum(visible_pairs(qa, qa + nq, ka, ka + nk, span) for qa, nq in segs[me] for ka, nk in segs[j])
                       for j in range(ring)) for me in range(ring))


def span_pairs_per_rank(seq: int, ring: int, layout: str, span: Span = FULL) -> list[int]:
    """Visible pairs each ring rank computes over one ring pass (one row of `seq` tokens)."""
    return [sum(row) for row in _pair_matrix(seq, ring, layout, span)]


def steps_with_work(seq: int, ring: int, layout: str, span: Span = FULL) -> int:
    """The most ring steps (its own block included) any rank computes anything in: the rest are skipped."""
    return max(sum(1 for p in row if p) for row in _pair_matrix(seq, ring, layout, span))


def engine_args(seq: int, span: Span) -> tuple[list[int] | None, int | None]:
    """(bounds, window) of seqpar.attention.pieces.plan_pieces for a span over one row of `seq` tokens: a window as
    its `window`, chunks as document boundaries (what seqpar's attention runs Llama 4's chunked layers as)."""
    if span.kind == "sliding":
        return None, span.size
    if span.kind == "chunked":
        return list(range(span.size, seq, span.size)), None
    return None, None


@functools.lru_cache(maxsize=256)
def span_rows_factor(seq: int, ring: int, span: Span) -> float:
    """How many kernel calls a query row is in over one zigzag ring pass on the busiest rank: the rows of the pieces
    seqpar's ring plans for this span (seqpar.attention.pieces: a window cuts each (q block, kv block) pair to what
    is in reach, and a step out of reach has none), over the local rows. memory.keep_attention keeps their outputs."""
    segs = [ring_segments(seq, ring, r, "zigzag") for r in range(ring)]
    bounds, window = engine_args(seq, span)
    rows = [sum(p.q1 - p.q0 for j in range(ring) for p in plan_pieces(segs[me], segs[j], True, bounds, window))
            for me in range(ring)]
    return max(rows) / (seq / ring)
