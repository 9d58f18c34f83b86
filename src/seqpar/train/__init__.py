"""`seqpar train`: the plain training loop behind the CLI, laid out as its data flows.

    config/     the run's YAML -> TrainConfig (schema, loading, checks that need the world or the model)
    model/      loading the model and tokenizer, checking them against the run, building the model a step trains
    dataset/    files -> rows -> formats -> token ids + labels -> packed examples -> per-rank streams and collators
    grpo/       stage: grpo's rollout (generate, score, advantages) and reward functions
    loop/       one step (micro-batches -> loss -> gradients -> update), the optimizer, eval, metrics, plots
    lifecycle/  the run around the loop: launch, process group, lock, resume, checkpoints, export
    run.py      train(cfg): checks -> process group -> loop -> steps -> export (one process of the run)
    verify.py   `seqpar verify`: an SP run against its SP=1 reference, losses and gradients

The step itself (micro_batch_loss, reference log-probs) lives in seqpar.steps, shared with the HF Trainer
and TRL drop-ins. Nothing here is imported by `import seqpar`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train", "TrainResult", "load_config", "config_from_dict"]


def __getattr__(name: str) -> Any:
    # Lazy: `seqpar.train.config` stays importable without loading the loop (and transformers).
    if name in ("train", "TrainResult"):
        from . import run

        return getattr(run, name)
    if name in ("load_config", "config_from_dict"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'seqpar.train' has no attribute {name!r}")
