"""What the planner plans for: the workload (length, stage, fine-tuning, precision), the SP x DP layout and the
memory features, as plain frozen dataclasses every planner module shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import ModelFacts

__all__ = ["Features", "Workload", "Layout", "DEFAULT_LOSS_CHUNK_BYTES", "INDEX_BYTES_PER_TOKEN"]

DEFAULT_LOSS_CHUNK_BYTES = 256 * 2**20  # MemorySpec.loss_chunk_tokens=None: one chunk's fp32 logits <= 256 MB
INDEX_BYTES_PER_TOKEN = 24  # int64 position_ids / shift_labels / their long copies


@dataclass(frozen=True)
class Features:
    activation_checkpointing: bool = False
    offload_activations: bool = False
    fused_loss: bool = False
    tiled_mlp: bool = False
    tiled_layer: bool = False  # the whole layer but attention in sequence tiles (planner.tiled)
    fsdp: bool = False
    offload_optimizer: bool = False  # FSDP CPU offload of parameters, gradients and optimizer state
    loss_chunk_tokens: int | None = None
    attention_head_chunks: int = 1  # memory.attention_head_chunks (planner.tiled.attention_backward_temp)
    keep_attention: bool = False  # memory.keep_attention: the kernels' outputs kept through checkpointing
    # offload on an accelerator prefetches the next layer input during a layer's backward (a second input on
    # the device); seqpar.memory.offload on CPU copies on demand (the validation runs)
    offload_prefetch: bool = True

    def as_dict(self) -> dict[str, bool]:
        return {k: v for k, v in self.__dict__.items()
                if k not in ("loss_chunk_tokens", "offload_prefetch", "attention_head_chunks", "keep_attention")}


@dataclass(frozen=True)
class Workload:
    seq_len: int
    stage: str = "sft"
    finetuning: str = "full"
    precision: str = "bf16"
    micro_batch_size: int = 1
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # positions per row without a label (prompt tokens, a row's last position): the fused loss computes
    # logits only for supervised positions. 0 = every position supervised (the upper bound).
    unsupervised_tokens: int = 0
    # which attention kernels the peak is planned for: "cuda" (flash / cuDNN: their backward's workspaces count,
    # planner.tiled.cuda_attention_workspace) or "cpu" (seqpar's CPU kernel: the validation rows' meter)
    device: str = "cuda"
    # hybrids under a ring: how the recurrent layers' states travel (seqpar.init_mesh's state_passing)
    state_passing: str = "chain"

    @property
    def elt(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def rows(self) -> int:
        return self.micro_batch_size * (2 if self.stage == "dpo" else 1)  # DPO: chosen + rejected rows

    @property
    def lora(self) -> bool:
        return self.finetuning == "lora"

    def supervised(self, local_tokens: int) -> int:
        """Supervised positions on the busiest rank: all its tokens, at most the rows' supervised total."""
        return max(1, min(local_tokens, self.rows * (self.seq_len - self.unsupervised_tokens)))

    def trained_tensors(self, m: ModelFacts) -> list[int]:
        """Element counts of the tensors this workload trains: every parameter, or each LoRA A and B."""
        return m.trainable_tensors(self.lora_r if self.lora else None, self.lora_targets)

    def trains(self, module: str) -> bool:
        """Whether a Linear keeps its input for a weight gradient (trained, or a LoRA target)."""
        return not self.lora or module in self.lora_targets


@dataclass(frozen=True)
class Layout:
    ulysses: int = 1
    ring: int = 1
    dp: int = 1

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.sp * self.dp
