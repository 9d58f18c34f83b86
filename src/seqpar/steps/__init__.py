"""One training step under SP, shared by every trainer: the `seqpar train` loop, the HF Trainer and TRL
drop-ins and the RL helpers. It sits below seqpar.hf and seqpar.trl (it imports only loss/, memory/ and
the mesh), so `import seqpar` never loads a trainer.

    forward.py      model_inputs / forward_token_stats: a collated shard -> per-token NLL (fused or full logits)
    reference.py    ReferenceLogps (DPO, per sequence), ReferenceTokenLogps (GRPO's KL, per token)
    micro_batch.py  StepSpec, count_items (the step's loss denominator), micro_batch_loss (SFT / DPO / GRPO)
"""

from .forward import forward_logits, forward_nll, forward_token_stats, model_inputs
from .micro_batch import StepSpec, count_items, micro_batch_loss, sft_metric_sums
from .reference import ReferenceLogps, ReferenceTokenLogps

__all__ = ["StepSpec", "count_items", "model_inputs", "forward_logits", "forward_nll", "forward_token_stats",
           "micro_batch_loss", "sft_metric_sums", "ReferenceLogps", "ReferenceTokenLogps"]
