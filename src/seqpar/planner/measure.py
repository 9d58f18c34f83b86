"""Measure one training step's per-rank peak memory (and time) with torch's MemTracker.

The step is the plain trainer's own (`seqpar.train.loop.step.train_step` on a loop built by
`seqpar.train.loop.build.build_loop`, as `seqpar train` builds it), so every memory feature switched on
in `TrainConfig.memory` is measured exactly as `seqpar train` runs it. A warm-up step first creates
the optimizer state; the second step is metered; a third, unmetered step is timed (`step_s`: the
meter's per-op overhead would distort times). Tiny models only (CPU, gloo): see planner.validate.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["Case", "measure_case", "case_config", "unsupervised_tokens"]


@dataclass(frozen=True)
class Case:
    """One validation row: a tiny model, a workload and a mesh (world = dp * ulysses * ring)."""

    arch: str = "llama"
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    seq_len: int = 256
    stage: str = "sft"
    finetuning: str = "full"
    fsdp: bool = False
    ulysses: int = 1
    ring: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    precision: str = "fp32"
    memory: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "fused"  # seqpar train's optimizer.implementation
    attention_kernel: str = "auto"  # "cpu_cuda_workspace": a row marked cuda (CUDA's attention workspace held)
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # more tiny_config keys (e.g. num_local_experts)

    @property
    def world(self) -> int:
        return self.dp * self.ulysses * self.ring

    def label(self) -> str:
        feats = ",".join(f"{k}={v}" for k, v in sorted(self.memory.items())) or "none"
        prec = "" if self.precision == "fp32" else f"{self.precision}: "
        shape = "" if self.num_layers == 2 else f" L={self.num_layers}"
        fsdp = "/fsdp" if self.fsdp else ""
        opt = "" if self.optimizer == "fused" else f" adamw:{self.optimizer}"
        cuda = " [cuda]" if self.attention_kernel == "cpu_cuda_workspace" else ""
        arch = self.arch + "".join(f" {k}={v}" for k, v in sorted(self.model_kwargs.items()))
        return (f"{prec}{arch}{shape} S={self.seq_len} {self.stage}/{self.finetuning}{fsdp} "
                f"u{self.ulysses}r{self.ring}d{self.dp} mem[{feats}]{opt}{cuda}")

    def __hash__(self) -> int:  # memory and model_kwargs are dicts
        return hash(self.label())


def case_config(case: Case) -> Any:
    from ..train.config import config_from_dict

    sp = case.ulysses * case.ring
    return config_from_dict({
        "model": {"name": f"tiny:{case.arch}", "kwargs": {
            "num_heads": case.num_heads, "num_kv_heads": case.num_kv_heads, "head_dim": case.head_dim,
            "num_layers": case.num_layers, "intermediate_size": case.intermediate_size,
            "vocab_size": case.vocab_size, "max_position_embeddings": max(4096, case.seq_len),
            **({"sliding_window": max(4096, case.seq_len)} if case.arch in ("qwen2", "mistral") else {}),
            **case.model_kwargs}},
        "dataset": {"path": "<synthetic>", "format": "text" if case.stage == "sft" else "dpo",
                    "max_length": case.seq_len, "shuffle": False},
        "stage": case.stage,
        "finetuning": {"method": case.finetuning},
        "sequence_parallel": {"size": sp, "ulysses_degree": case.ulysses, "ring_degree": case.ring},
        "fsdp": case.fsdp,
        # No key = feature off (fused_loss defaults to on in TrainConfig; the planner names it explicitly).
        "memory": {"fused_loss": False, **case.memory},
        "precision": case.precision,
        "attention_kernel": case.attention_kernel,
        "optimizer": {"implementation": case.optimizer},
        "micro_batch_size": case.micro_batch_size,
        "max_steps": 8,
        "progress": False,
    }, source="validation case")


def _synthetic_examples(case: Case, tok: Any, n: int) -> list[Any]:
    """Rows that fill max_length exactly (truncated), every token supervised, deterministic."""
    from ..train.dataset.tokenize import build_examples

    rng = random.Random(0)
    text = lambda k: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(k))  # noqa: E731
    if case.stage == "sft":
        rows = [{"text": text(case.seq_len + 8)} for _ in range(n)]
        return build_examples(rows, "text", "sft", tok, case.seq_len, False)[0]
    p = case.seq_len // 4
    rows = [{"prompt": text(p), "chosen": text(case.seq_len), "rejected": text(case.seq_len)} for _ in range(n)]
    return build_examples(rows, "dpo", "dpo", tok, case.seq_len, False)[0]


def unsupervised_tokens(case: Case) -> int:
    """Positions per row without a label in the case's synthetic rows (the fewest over rows): SFT rows
    are fully supervised but their last position (no next token); DPO rows also leave the prompt out."""
    from ..train.model.load import load_tokenizer

    if case.stage == "sft":
        return 1
    examples = _synthetic_examples(case, load_tokenizer(case_config(case)), 2)
    return min(min(len(e["prompt_input_ids"]), case.seq_len - 1) for e in examples)


def _step_tracker() -> Any:
    """torch's MemTracker, allowing the root module to run forward twice in one step (DPO with LoRA:
    the reference pass is the policy with its adapter disabled). Only the per-module statistics, which
    we do not read, are reset; the peak snapshot is global and kept."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            root = set(self._mod_tracker.parents) - {name} == {"Global"}
            if module in self.memory_tracking and root and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            _skip_frozen_grad_hooks(self, module, hook_trainable=False)  # FSDP2 gathers fresh frozen params
            super()._pre_fw_hook(module, inputs)

    return _StepMemTracker()


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen_grad_hooks(mt: Any, *modules: Any, hook_trainable: bool = True) -> None:
    """MemTracker registers a grad hook on every parameter when its module first runs, which torch
    refuses for a frozen one (LoRA base weights, the DPO reference copy, LoRA weights inside peft's
    disable_adapter()). Mark frozen parameters as hooked and hook the trainable ones now, while they
    still require grad, so the tracker never tries later."""
    for m in modules:
        if m is None:
            continue
        for p in m.parameters():
            if not p.requires_grad and p not in mt._param_to_grad_hook_handles:
                mt._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        if hook_trainable:
            mt._track_module_params_and_buffers(m, install_grad_hooks=True)


def measure_case(case_d: dict[str, Any], meter: bool = True, timed_steps: int = 1,
                 collectives: bool = False) -> dict[str, Any]:
    """Per-rank body (under run_distributed): peak bytes per MemTracker category + step seconds (the
    median of `timed_steps` unmetered steps). meter=False skips the metered step (timing only);
    collectives=True also counts one step's collective calls per kind (torch.profiler's c10d ops)."""
    import torch.distributed as dist

    from ..mesh import init_mesh
    from ..train.loop.build import build_loop
    from ..train.loop.step import train_step
    from ..train.model.load import load_model, load_tokenizer

    case = Case(**case_d)
    cfg = case_config(case)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cpu")
    tok = load_tokenizer(cfg)
    examples = _synthetic_examples(case, tok, 2 * case.micro_batch_size * max(1, case.dp))
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    mesh = init_mesh(cfg.sequence_parallel.size, ulysses_degree=case.ulysses, ring_degree=case.ring)
    loop = build_loop(cfg, mesh, model, tok, examples, device, world, rank)
    model, optimizer, reference = loop.model, loop.optimizer, loop.reference
    train_step(loop, 0)  # warm-up: the optimizer state exists from here on
    out = _metered_step(loop, model, optimizer, reference, device) if meter else {}
    calls = _count_collectives(loop) if collectives else {}
    # Step time WITHOUT the meter (its per-op overhead would favour configurations with fewer ops).
    times = []
    for i in range(timed_steps):
        t0 = time.perf_counter()
        train_step(loop, 2 + i)
        times.append(time.perf_counter() - t0)
    return {"case": asdict(case), "peak": out, "step_s": statistics.median(times), "rank": rank, "collectives": calls}


# c10d ops as the dispatcher records them -> planner.collectives kinds (a functional all_reduce and
# all_gather_into_tensor dispatch to these too, so each call is counted once).
PROFILER_KINDS = {"c10d::alltoall_base_": "all_to_all", "c10d::send": "p2p", "c10d::allreduce_": "all_reduce",
                  "c10d::_allgather_base_": "all_gather", "c10d::allgather_into_tensor_coalesced_": "all_gather",
                  "c10d::_reduce_scatter_base_": "reduce_scatter"}


def _count_collectives(loop: Any) -> dict[str, int]:
    from torch.profiler import profile

    from ..train.loop.step import train_step

    with profile() as prof:
        train_step(loop, 1)
    calls: dict[str, int] = {}
    for e in prof.key_averages():
        if e.key in PROFILER_KINDS:
            calls[PROFILER_KINDS[e.key]] = calls.get(PROFILER_KINDS[e.key], 0) + e.count
    return calls


def _metered_step(loop: Any, model: Any, optimizer: Any, reference: Any, device: torch.device) -> dict[str, int]:
    from ..train.loop.step import train_step

    mt = _step_tracker()
    ref_model = getattr(reference, "ref_model", None)
    # bf16 without FSDP: the fp32 masters are the optimizer's parameters but no tracked module's; MemTracker
    # counts an optimizer's states only, so they are tracked as their own module (else 4 bytes per parameter
    # the step holds go unseen)
    masters = getattr(getattr(loop, "prec", None), "module", None)
    _skip_frozen_grad_hooks(mt, model, ref_model)
    mt.track_external(*(x for x in (model, optimizer, ref_model, masters) if x is not None))
    with mt:
        train_step(loop, 1)
    snap = mt.get_tracker_snapshot("peak")
    dev_snap = snap.get(device) or next(iter(snap.values()))
    return {str(k.value if hasattr(k, "value") else k): int(v) for k, v in dev_snap.items()}
