"""The optimizer (AdamW or SGD over the trainable parameters, or their fp32 masters) and the learning-rate
schedule (warmup, then constant / linear / cosine over max_steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..config import TrainConfig

__all__ = ["build_optimizer", "lr_lambda", "IMPLEMENTATIONS"]

# optimizer.implementation -> torch.optim keyword arguments
IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for_loop": {"foreach": False},
}


def build_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    o = cfg.optimizer
    impl = IMPLEMENTATIONS[o.implementation]
    if o.name == "adamw":
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **impl)
    else:
        # torch's fused SGD has no DTensor (FSDP2) support: "fused" leaves SGD on torch's default path
        sgd = {} if o.implementation == "fused" else impl
        optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay, **sgd)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    total, kind = cfg.max_steps, cfg.schedule.name
    warm = cfg.schedule.warmup(total)

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        return 1.0 - frac if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return f
