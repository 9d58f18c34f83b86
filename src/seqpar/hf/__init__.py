"""Hugging Face integration: run unmodified transformers causal LMs under seqpar sequence parallelism."""

from .attention import ForwardPlan, apply_sequence_parallel, is_sequence_parallel, remove_sequence_parallel
from .models import (
    ARCHS,
    HYBRID_ARCHS,
    VLM_ARCHS,
    load_smollm2,
    load_smollm2_tokenizer,
    smollm2_cache_dir,
    smollm2_path,
    tiny_config,
    tiny_model,
)
from .vision import sp_vlm_inputs

__all__ = [
    "ARCHS",
    "HYBRID_ARCHS",
    "VLM_ARCHS",
    "ForwardPlan",
    "apply_sequence_parallel",
    "is_sequence_parallel",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "remove_sequence_parallel",
    "smollm2_cache_dir",
    "smollm2_path",
    "tiny_config",
    "tiny_model",
    "sp_vlm_inputs",
    "SequenceParallelTrainer",
    "SequenceParallelDPOTrainer",
]


def __getattr__(name: str):
    # Lazy: importing seqpar.hf must not pull in transformers.Trainer / accelerate.
    if name in ("SequenceParallelTrainer", "SequenceParallelDPOTrainer"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'seqpar.hf' has no attribute {name!r}")
