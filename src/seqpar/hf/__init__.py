"""Hugging Face integration: run unmodified transformers causal LMs under seqpar sequence parallelism.

    attention.py          apply_sequence_parallel / remove_sequence_parallel (a scoped attention registration);
                          use_mesh (length-aware SP: the mesh of each micro-batch)
    forward_plan.py       the per-forward plan: full length and packed documents, from the full position_ids
    attention_fn.py       the attention functions the layers call, with their per-call refusals
    linear_attention.py   Gated DeltaNet (Qwen3-Next / Qwen3.5 / OLMo-hybrid) under Ulysses, ring, USP; mixers.py:
                          refused sequence mixers; recurrent_layers.py: the recurrent / conv mixers seqpar runs
                          (mamba2.py, mamba1.py, kda.py, lightning.py, rglru.py, short_conv.py)
    vision.py             Qwen2.5-VL / Qwen3-VL: vision tower local, text decoder under SP
    prepare.py            prepare_model / frozen_reference: the one model preparation of every trainer
    trainer.py            SequenceParallelTrainer / SequenceParallelDPOTrainer (Trainer drop-ins), with
                          trainer_args.py, trainer_stack.py (DDP / FSDP2 / DeepSpeed), trainer_eval.py
    generation.py         sampling for GRPO from an SP model; models.py, cache.py: tiny models, SmolLM2
    equivalence.py        a small SP-vs-no-SP check (tests, `seqpar verify`)
    family_sweep.py       every causal-LM family of the installed transformers, tiny, exact under SP 2 or refused
                          (family_configs.py: the list and the tiny configs; family_table.py: docs/hf.md's table)
"""

from .attention import (
    ForwardPlan,
    apply_sequence_parallel,
    check_mesh,
    is_sequence_parallel,
    remove_sequence_parallel,
    use_mesh,
)
from .models import (
    ARCHS,
    HYBRID_ARCHS,
    TINY_ARCHS,
    VARIANT_ARCHS,
    VLM_ARCHS,
    load_smollm2,
    load_smollm2_tokenizer,
    smollm2_cache_dir,
    smollm2_path,
    tiny_config,
    tiny_model,
)
from .prepare import PrepareSpec, frozen_reference, prepare_model
from .vision import sp_vlm_inputs

__all__ = [
    "ARCHS",
    "HYBRID_ARCHS",
    "TINY_ARCHS",
    "VARIANT_ARCHS",
    "VLM_ARCHS",
    "ForwardPlan",
    "PrepareSpec",
    "frozen_reference",
    "prepare_model",
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
    "use_mesh",
    "check_mesh",
    "SequenceParallelTrainer",
    "SequenceParallelDPOTrainer",
]


def __getattr__(name: str):
    # Lazy: importing seqpar.hf must not pull in transformers.Trainer / accelerate.
    if name in ("SequenceParallelTrainer", "SequenceParallelDPOTrainer"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'seqpar.hf' has no attribute {name!r}")
