"""Resume rules: which checkpoint a run continues from, refusing one written by a different run, and what a
resume on another layout does.

Reads files only (no collectives), so every rank -- and the launching `seqpar train --nproc-per-node`
process, before torchrun starts -- reaches the same decision with the same message.

A checkpoint continues a run only when what defines the run is unchanged: the keys in `MUST_MATCH` (dataset.path
compared resolved, so a path given relative to the config file or on the command line is the same path), and the
data itself: the examples' fingerprint (train/dataset/identity.py; the data position is a row count into them),
which also lets the data move to another path with the same content. The layout may change -- world size,
sequence_parallel (size, degrees, layout), dp size, FSDP2, nodes (run_layout.py) -- and so may micro_batch_size /
grad_accum / global_batch_size: the same global batch continues the uninterrupted trajectory, another one is
announced (steps per epoch, the row the data continues at). `max_steps` may change (grow, to train longer), and so may
checkpointing, export, progress and memory settings (exactness features: same loss and gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import SeqParError
from ...textfiles import read_json
from ..config import TrainConfig
from ..dataset.identity import DataIdentity, resolved_path
from .checkpoint import checkpoint_step, latest_name
from .lock import run_identity
from .output_dir import (
    checkpoint_damage,
    clear_results,
    complete_checkpoints,
    refuse_nested_output_dir,
    refuse_overwrite,
)
from .run_layout import RunLayout, checkpoint_rows, layout_meta, resume_lines, row_unit

__all__ = ["run_meta", "MUST_MATCH", "find_resume", "config_differences", "resume_point", "checkpoint_to_resume",
           "check_output_dir", "RUN_FILE", "ResumePlan", "plan_resume", "resume_start"]

# <output_dir>/.seqpar_run: the run id of the run that wrote the results (a torchrun restart of the same run
# may start over them; any other fresh run may not, unless overwrite_output_dir).
RUN_FILE = ".seqpar_run"

MUST_MATCH = ("model", "dataset", "stage", "dpo", "grpo", "finetuning", "precision", "optimizer", "schedule", "seed")


def run_meta(cfg: TrainConfig, world: int, layout: RunLayout | None = None, rows: int = 0,
             data: DataIdentity | None = None) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (checkpoint-N/run.json): the config and world size,
    (layout given) the layout and data position (run_layout.py), and (data given) the data's identity."""
    meta: dict[str, Any] = {"config": cfg.model_dump(mode="json"), "world_size": world}
    if layout is not None:
        meta.update(layout_meta(layout, rows, data.rows if data is not None else None))
    if data is not None:
        meta["data"] = data.meta()
    return meta


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def config_differences(saved: dict[str, Any], cfg: TrainConfig, skip: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys (within MUST_MATCH, less `skip`) whose value differs, as 'key: saved -> now'; dataset.path is
    compared resolved (a relative one against the working directory)."""
    now = cfg.model_dump(mode="json")
    diffs = []
    for top in MUST_MATCH:
        a, b = _flatten(saved.get(top), top), _flatten(now.get(top), top)
        for k in sorted(set(a) | set(b)):
            same = (_same_path(a.get(k), b.get(k)) if k == "dataset.path" else a.get(k) == b.get(k))
            if k not in skip and not same:
                diffs.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return diffs


def _same_path(a: Any, b: Any) -> bool:
    return isinstance(a, str) and isinstance(b, str) and resolved_path(a) == resolved_path(b)


def _saved_meta(ckpt: Path) -> dict[str, Any] | None:
    run = ckpt / "run.json"
    if run.is_file():
        meta = read_json(run, "checkpoint record")
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict) or "world_size" not in meta:
            raise SeqParError(f"checkpoint record {run} lacks the config or world size that wrote it: it is damaged; "
                              f"restore it, or delete {ckpt} to resume from an earlier checkpoint")
        return meta
    cfg = ckpt.parent / "config.json"  # checkpoints written before run.json existed
    if cfg.is_file():
        ranks = len(list(ckpt.glob("trainer_state_rank*.pt")))
        return {"config": read_json(cfg, "run config"), "world_size": ranks}
    return None


def checkpoint_to_resume(out: Path) -> tuple[Path | None, str | None]:
    """The checkpoint `out` continues from, and a line to print when it is not the one `latest` names.
    SeqParError when checkpoints exist but every one is damaged (never a silent fresh start over them)."""
    complete = complete_checkpoints(out)
    marker = out / "latest"
    named = latest_name(out)
    damaged = {c: d for c in complete if (d := checkpoint_damage(c)) is not None}
    good = [c for c in complete if c not in damaged]
    if named is not None and (out / named) in good:
        return out / named, None
    if not good:
        if damaged:
            worst = max(damaged, key=checkpoint_step)
            raise SeqParError(f"checkpoint {worst} is damaged ({damaged[worst]}) and no earlier checkpoint is intact: "
                              f"delete the damaged checkpoints and start fresh (--overwrite), or restore them")
        return None, None
    if named is not None and (out / named) in damaged:
        why = f"{out / named} is damaged ({damaged[out / named]})"
    else:
        why = f"{marker} names {named}, which is missing or incomplete" if named else f"{marker} is missing"
    return good[-1], f"{why}: resuming from the newest intact checkpoint, {good[-1]}"


def find_resume(cfg: TrainConfig) -> tuple[Path, int] | None:
    """(checkpoint, step) this run resumes from, None for a fresh start; SeqParError when it may not resume."""
    if not cfg.checkpoint.resume:
        return None
    ckpt, _ = checkpoint_to_resume(Path(cfg.output_dir))
    if ckpt is None:
        return None
    step = checkpoint_step(ckpt)
    fresh = ("to start fresh over it, set checkpoint.resume: false and overwrite_output_dir: true (--set "
             "checkpoint.resume=false --overwrite), or use a new output_dir; to continue, run with the checkpoint's "
             "settings")
    meta = _saved_meta(ckpt)
    if meta is None:
        raise SeqParError(f"{ckpt} (step {step}) has no run.json and {ckpt.parent / 'config.json'} is missing, so "
                          f"it cannot be checked against this config: {fresh}")
    # with the data's identity recorded, the data decides whether another dataset.path is the same data (plan_resume)
    diffs = config_differences(meta["config"], cfg, skip=("dataset.path",) if "data" in meta else ())
    if diffs:
        raise SeqParError(
            f"cannot resume from {ckpt} (step {step}): the run that wrote it differs in\n  " + "\n  ".join(diffs)
            + f"\n{fresh}"
        )
    _refuse_mid_rollout(cfg, ckpt, step)
    return ckpt, step


@dataclass(frozen=True)
class ResumePlan:
    """A checkpoint to continue from, at this launch's layout: its step and data position (global rows), the
    layout it was written at, and the lines that say what the resume does (run_layout.resume_lines)."""

    ckpt: Path
    step: int
    rows: int
    saved: RunLayout
    lines: tuple[str, ...]


def plan_resume(cfg: TrainConfig, now: RunLayout, data: DataIdentity) -> ResumePlan | None:
    """find_resume, and what continuing it at layout `now` does; SeqParError when the data changed (the data
    position counts rows of it): which of path, file content, examples or their number. `cfg`: grad_accum resolved
    for now.dp; `data`: this run's (dataset/identity.py)."""
    found = find_resume(cfg)
    if found is None:
        return None
    ckpt, step = found
    meta = _saved_meta(ckpt)
    refusals, notes = _data_changes(cfg, meta, data)
    if refusals:
        raise SeqParError(f"cannot resume from {ckpt} (step {step}): its data is not this run's: "
                          + "; ".join(refusals) + ", so its data position (a row count) would point elsewhere: "
                          "restore that dataset, or start fresh (checkpoint.resume: false with --overwrite, or a new "
                          "output_dir)")
    saved = RunLayout.from_meta(meta)
    rows = checkpoint_rows(ckpt, meta, data.rows)
    return ResumePlan(ckpt, step, rows, saved, tuple(notes + resume_lines(ckpt, saved, now, rows, data.rows)))


def _refuse_mid_rollout(cfg: TrainConfig, ckpt: Path, step: int) -> None:
    """GRPO with num_iterations n samples a rollout at steps 0, n, 2n, ... and trains n steps on it; a checkpoint
    holds no rollout (its completions, old log-probs), so a run continues only from one at a multiple of n (the
    final checkpoint of a max_steps that is not one may be exported, not continued)."""
    n = cfg.grpo.num_iterations if cfg.stage == "grpo" and cfg.grpo is not None else 1
    if step % n and step < (cfg.max_steps or 0):
        raise SeqParError(f"cannot resume from {ckpt} (step {step}): it was written in the middle of a rollout's "
                          f"grpo.num_iterations={n} steps, and a checkpoint does not hold the rollout (its completions "
                          f"and old log-probs): resume from a checkpoint at a multiple of {n} (remove the later ones), "
                          "or start fresh")


def _data_changes(cfg: TrainConfig, meta: dict[str, Any], data: DataIdentity) -> tuple[list[str], list[str]]:
    """(refusals, notes) about the data: by its recorded identity, else (older checkpoints) by its size."""
    if isinstance(meta.get("data"), dict):
        return data.changes(meta["data"])
    saved_n = meta.get("examples")
    if saved_n is not None and int(saved_n) != data.rows:
        return [f"its run had {saved_n} {row_unit(cfg)} and this dataset gives {data.rows}"], []
    return [], []


def resume_start(cfg: TrainConfig, examples: int) -> tuple[int, int] | None:
    """(step, rows) of the checkpoint this run would resume from, None for none or one it may not resume (the
    refusal comes from find_resume / plan_resume). Every rank reads it (num_epochs -> max_steps)."""
    try:
        found = find_resume(cfg)
        if found is None:
            return None
        return found[1], checkpoint_rows(found[0], _saved_meta(found[0]), examples)
    except (SeqParError, OSError, KeyError, ValueError):
        return None


def check_output_dir(cfg: TrainConfig, layout: RunLayout, data: DataIdentity) -> ResumePlan | None:
    """plan_resume, and for a fresh start the refusal to replace an earlier run's results (output_dir.py)."""
    out = Path(cfg.output_dir)
    refuse_nested_output_dir(out)
    found = plan_resume(cfg, layout, data)
    if found is None and not _same_run(out):
        refuse_overwrite(out, cfg.overwrite_output_dir)
    return found


def _same_run(out: Path) -> bool:
    """The results in `out` are this run's own (a torchrun restart before its first checkpoint)."""
    f = out / RUN_FILE
    return f.is_file() and f.read_bytes().decode("utf-8", "replace").strip() == run_identity()[0]


def resume_point(cfg: TrainConfig, now: RunLayout, data: DataIdentity, rank: int, out: Path) -> ResumePlan | None:
    """The checkpoint to resume from (announced, with what the layout change does), or None (rank 0 clears the
    folder for a fresh start)."""
    plan = plan_resume(cfg, now, data)
    if rank == 0:
        if plan is None:
            removed = clear_results(out) if cfg.overwrite_output_dir and not _same_run(out) else []
            if removed:
                print(f"[seqpar] overwrite_output_dir: removed the earlier run's {', '.join(removed)}", flush=True)
            (out / RUN_FILE).write_text(run_identity()[0] + "\n")
        else:
            note = checkpoint_to_resume(out)[1]
            if note:
                print(f"[seqpar] {note}", flush=True)
            print(f"[seqpar] resuming from step {plan.step}: {plan.ckpt}", flush=True)
            for line in plan.lines:
                print(f"[seqpar] {line}", flush=True)
            if plan.step >= cfg.max_steps:
                print(f"[seqpar] this run is already complete: {plan.ckpt.name} is at step {plan.step} and max_steps "
                      f"is {cfg.max_steps}; to train further, raise max_steps (--max-steps N) and run again: it "
                      "resumes from there", flush=True)
    return plan
