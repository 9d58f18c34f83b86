"""TRL drop-ins under sequence parallelism (extra: `pip install 'seqpar[trl]'`).

    from seqpar.trl import SequenceParallelSFTTrainer          # was: from trl import SFTTrainer
    trainer = SequenceParallelSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                                         processing_class=tok, sequence_parallel_size=2)

TRL prepares the dataset (tokenisation, chat templates, completion/assistant masks, truncation,
packing); seqpar takes over from the tokenised rows (see seqpar.trl.trainer). `import trl` happens
here, so `import seqpar` never needs TRL.

    trainer.py     SequenceParallelSFTTrainer, SequenceParallelDPOTrainer (TRL's logged metrics under SP)
    grpo.py        SequenceParallelGRPOTrainer (grpo_media.py: image prompts; grpo_vllm.py: use_vllm, seqpar's engine)
    args.py        what they share: TRL config coercion, model instantiation (PEFT first), common refusals
    collators.py   seqpar's collators over TRL's prepared rows
    sft_vision.py  the SFT drop-in with images: TRL's vision collator's batch -> seqpar's vision batch
"""

from __future__ import annotations

from ..errors import SeqParError

try:
    import trl as _trl  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise SeqParError(
        f"seqpar.trl needs TRL (import failed: {e}): pip install 'seqpar[trl]'"
    ) from e

from .args import let_trl_configs_run_on_cpu
from .grpo import SequenceParallelGRPOTrainer
from .trainer import SequenceParallelDPOTrainer, SequenceParallelSFTTrainer

let_trl_configs_run_on_cpu()  # TRL's bf16 default on a CPU-only machine: see the function

__all__ = ["SequenceParallelSFTTrainer", "SequenceParallelDPOTrainer", "SequenceParallelGRPOTrainer"]
