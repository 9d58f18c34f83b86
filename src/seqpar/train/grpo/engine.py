"""`grpo.rollout`'s engines for the plain loop: which one samples, the vLLM engine's settings from the config,
the checks before launch, and rollouts.jsonl (`grpo.log_rollouts`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ... import comm
from ...errors import SeqParError
from ...hf.generation import generate_for_group
from ...mesh import SequenceParallelMesh
from ..config import TrainConfig
from ..config.rollout import resolve_tensor_parallel

__all__ = ["check_rollout_engine", "RolloutEngine", "write_rollouts", "trim_rollouts"]


def check_rollout_engine(cfg: TrainConfig, config: Any, sp_size: int) -> None:
    """Before launch: what engine: vllm cannot do with this config and model at SP size `sp_size` (the rollout
    mesh's) (one line, naming the fix)."""
    g = cfg.grpo
    if cfg.stage != "grpo" or g is None or g.rollout.engine != "vllm":
        return
    r = g.rollout
    need = g.max_prompt_length + g.max_completion_length
    if r.max_model_len is not None and r.max_model_len < need:
        raise SeqParError(f"grpo.rollout.max_model_len={r.max_model_len} < grpo.max_prompt_length + "
                          f"grpo.max_completion_length = {need}: raise it, or leave it unset (dataset.max_length)")
    from ...hf.vllm_models import check_vllm_model

    tp = resolve_tensor_parallel(r, sp_size)
    check_vllm_model(config, on_cuda=torch.cuda.is_available(), tensor_parallel=tp)


class RolloutEngine:
    """Samples one rollout of an SP group with the configured engine: (completions, their log-probs)."""

    def __init__(self, cfg: TrainConfig, mesh: SequenceParallelMesh, tok: Any) -> None:
        self.cfg, self.mesh, self.tok, self.g = cfg, mesh, tok, cfg.grpo
        self.vllm: Any = None
        if self.g.rollout.engine == "vllm":
            from ...hf.vllm_rollout import VLLMRollout, VLLMSettings

            r = self.g.rollout
            # the engines' TP size: the SP size (one engine per SP group) or 1 (checked before launch)
            self.vllm = VLLMRollout(VLLMSettings(
                max_model_len=r.max_model_len or cfg.dataset.max_length,
                max_num_seqs=cfg.micro_batch_size * cfg.grad_accum, gpu_memory_utilization=r.gpu_memory_utilization,
                enforce_eager=r.enforce_eager, sleep=r.sleep,
                tensor_parallel=resolve_tensor_parallel(r, mesh.sp_size),
                timeout_s=cfg.collective_timeout.total_seconds()))

    def generate(self, model: torch.nn.Module, prompts: list[list[int]], step: int, index: list[int],
                 media: list[dict] | None) -> tuple[list[list[int]], list[list[float]]]:
        g = self.g
        kw = dict(num_generations=g.num_generations, max_new_tokens=g.max_completion_length,
                  temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seed=self.cfg.seed, step=step,
                  eos_token_id=self.tok.eos_token_id, prompt_index=index)
        if self.vllm is not None:
            return self.vllm.for_prompts(model, self.mesh, prompts, **kw)
        return generate_for_group(model, self.mesh, prompts, pad_token_id=self.tok.pad_token_id, media=media,
                                  return_logprobs=True, **kw)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()


def write_rollouts(path: Path, mesh: SequenceParallelMesh, rows: list[dict[str, Any]]) -> None:
    """Append this step's rollout rows (each SP group's, gathered over dp) to `path` on global rank 0."""
    if mesh.sp_rank != 0 and mesh.sp_size > 1:
        rows = []  # the group's first rank speaks for it (every rank of a group holds the same rows)
    parts = comm.all_gather_object(rows, mesh.dp_group) if mesh.dp_size > 1 else [rows]
    if mesh.dp_rank == 0 and mesh.sp_rank == 0:
        try:
            with open(path, "a") as f:
                for part in parts:
                    for r in part:
                        f.write(json.dumps(r) + "\n")
        except OSError as e:
            raise SeqParError(f"grpo.log_rollouts: cannot write {path}: {e}") from None


def trim_rollouts(path: Path, start_step: int) -> None:
    """rollouts.jsonl as the run starting at `start_step` continues it: a fresh start (0) removes it, a resume keeps
    the rows of steps <= start_step (a run stopped after its last checkpoint wrote rows the resumed run redoes)."""
    if start_step == 0 or not path.is_file():
        path.unlink(missing_ok=True)
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= start_step]
    path.write_text("".join(line + "\n" for line in keep))

