"""Linear recurrences (Gated DeltaNet, Mamba2 / SSD, Mamba1, lightning, RG-LRU) over a sequence split across a
ring, with state passing.

    segments.py   where this ring rank's segments sit in the full sequence; document pieces; global chunk order
    halo.py       the causal conv's (kernel_size - 1)-token history from the chunks before a segment
    combine.py    every chunk's incoming state from the chunks' affine transitions: chain (P2P) or scan (all-gather)
    engine.py     the driver: conv with halo -> recurrence from a zero state per piece -> combine -> correction;
                  ring_conv: a conv with halo alone (short convolutions)
    delta.py      the gated delta rule's piece (one kernel call with [v | 0] from [0 | I] gives M and the correction)
    ssd.py        Mamba2's SSD piece (a scalar decay per head)
    selective.py  Mamba1's selective-scan piece (a decay per channel and state entry)
    lightning.py  MiniMax's lightning-attention piece (a constant decay per head)
    diagonal.py   a diagonal linear recurrence h_t = a_t h_{t-1} + x_t (RecurrentGemma's RG-LRU)

Model adapters (projections, head slices, norms) live in seqpar.hf (linear_attention.py, mamba2.py, rglru.py, ...).
"""

from .combine import KINDS, MODES, incoming_states
from .delta import delta_piece
from .diagonal import diagonal_piece
from .engine import PieceResult, ring_conv, ring_recurrence
from .halo import conv_with_halo, gather_halos
from .lightning import lightning_piece
from .segments import RingPlan, ring_plan
from .selective import SelectiveParams, selective_piece
from .ssd import SSDParams, ssd_piece

__all__ = ["KINDS", "MODES", "PieceResult", "RingPlan", "SSDParams", "SelectiveParams", "conv_with_halo",
           "delta_piece", "diagonal_piece", "gather_halos", "incoming_states", "lightning_piece", "ring_conv",
           "ring_plan", "ring_recurrence", "selective_piece", "ssd_piece"]
