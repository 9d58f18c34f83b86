"""Data path for sequence parallelism: collators (SFT, DPO) and an SP-aware sampler.

    sequence.py    full-sequence helpers: document starts, cu_seqlens, labels shifted on the full sequence
    collators.py   SequenceParallelCollator, SequenceParallelDPOCollator (row checks, padding, sharding)
    sampler.py     SequenceParallelSampler, sp_sampler
    vision.py      VisionCollator, VisionDPOCollator: vision-language rows / DPO pairs (full input ids + media)

What the collators guarantee:
- labels are shifted on the FULL sequence before sharding, so no target is lost at a shard
  boundary, and never across a document boundary (a new document starts wherever position_ids
  are not the previous position + 1);
- position_ids are global (reset to 0 per packed document) and returned explicitly;
- the full length is padded to what the mesh needs (`seqpar.padded_length`); padding is on the
  right (its own last document when packing), never supervised, and -- attention being causal --
  never attended to by real tokens;
- cu_seqlens are computed from the FULL position_ids before slicing;
- every per-token field is sliced with `seqpar.shard`; token counts describe the FULL batch, so
  they are identical on every SP rank and equal the counts without SP.

Truncation: with `max_length`, rows (and, when packing, the packed sequence) longer than
`max_length` are cut on the right and the number of dropped tokens is returned as
"num_truncated_tokens"; pass `truncate=False` to raise SeqParError instead.
"""

from __future__ import annotations

from .collators import SequenceParallelCollator, SequenceParallelDPOCollator
from .sampler import SequenceParallelSampler, sp_sampler
from .sequence import cu_seqlens_from_position_ids, document_starts, shift_labels_full
from .vision import VisionCollator, VisionDPOCollator

__all__ = [
    "SequenceParallelCollator",
    "SequenceParallelDPOCollator",
    "VisionCollator",
    "VisionDPOCollator",
    "SequenceParallelSampler",
    "sp_sampler",
    "document_starts",
    "cu_seqlens_from_position_ids",
    "shift_labels_full",
]
