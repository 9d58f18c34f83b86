"""bf16 mixed precision without FSDP: bf16 weights for compute, fp32 master weights in the optimizer.

`precision: bf16` means what HF Trainer's `bf16=True` means: updates accumulate in fp32, so small
steps are not rounded away. FSDP2 does this itself (MixedPrecisionPolicy); without FSDP this class
does it. Not autocast: under autocast RoPE promotes q/k to fp32 while v stays bf16, and the SP
attention requires one dtype. So the model's weights ARE bf16 and, per step:

    backward (bf16 grads) -> grads_to_masters (fp32 .grad on the masters; the model's grads freed)
    -> sum over dp x sp, clip, optimizer.step on the masters -> masters_to_model (round to bf16).

`module` holds the masters under the model's own parameter names (an empty module tree mirroring
the model), so checkpoints and the final state save the fp32 masters with the usual keys.
"""

from __future__ import annotations

import torch

__all__ = ["MasterWeights"]


class MasterWeights:
    """fp32 master copies of a model's trainable (low-precision) parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        self.module = torch.nn.Module()
        self.masters: list[torch.nn.Parameter] = []
        for name, p in named:
            m = torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
            _register(self.module, name, m)
            self.masters.append(m)

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """fp32 copies of the model's gradients on the masters (None stays None); frees the model's."""
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Round the masters into the model's weights (after each optimizer step, and after a resume)."""
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)


def _register(root: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            mod.add_module(part, child)
        mod = child
    mod.register_parameter(leaf, param)
