"""`seqpar verify`: the same config with SP and with SP=1: losses AND gradients compared, curves overlaid.

The SP run is launched under torchrun (N processes); the reference runs in THIS process with SP=1,
no FSDP (bf16 + FSDP: FSDP2 on one rank, for the same fp32 master weights), playing all dp slots of
the SP run (`train(..., emulate_dp=dp)`): every step sees the same rows in the same micro-batches
with the same global token normalisation, so the losses must agree
to floating-point noise (fp32: 1e-5). Loss curves cannot see a constant gradient-scale error (AdamW
is invariant to it), so `passed` also needs the per-step global pre-clip gradient norms (relative
error) and the full pre-clip gradient of step 1 (max abs difference; `seqpar.train.grads`) to agree.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ..errors import SeqParError
from .config import TrainConfig, config_from_dict
from .lifecycle.output_dir import existing_results, refuse_nested_output_dir, runs_around
from .loop.grads import GRAD_DUMP_ENV, grad_dump_errors, grad_norm_errors
from .loop.plots import plot_curves, read_metrics

__all__ = ["verify", "torchrun_command", "write_config", "check_verify_folder", "VERIFY_FILES", "without_dropout"]

VERIFY_FILES = ("sp_config.yaml", "ref_config.yaml", "verify.json")  # in an output folder verify wrote

DEFAULT_TOL = {"fp32": 1e-5, "bf16": 5e-2, "bf16-pure": 5e-2}
# Gradient bars: relative error of the per-step global grad norm; step-1 gradient: max abs difference
# (fp32), or that divided by max |g_ref| (bf16, whose rounding scales with the gradient).
GRAD_NORM_TOL = {"fp32": 1e-4, "bf16": 5e-2, "bf16-pure": 5e-2}
GRAD_STEP1_TOL = {"fp32": 1e-5, "bf16": 5e-2, "bf16-pure": 5e-2}


@contextlib.contextmanager
def _env(key: str, value: str) -> Iterator[None]:
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def write_config(cfg: TrainConfig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = cfg.model_dump(mode="json")
    # Absolute paths: load_config resolves relative ones against the directory of the YAML written here.
    data["output_dir"] = str(Path(cfg.output_dir).absolute())
    for name in ("dataset", "eval_dataset"):
        if data.get(name):
            data[name]["path"] = str(Path(data[name]["path"]).absolute())
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def torchrun_command(nproc: int, args: list[str], max_restarts: int = 0) -> list[str]:
    """`python -m torch.distributed.run ... -m seqpar <args>` on a free local port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "-m", "seqpar", *args]


def verify(cfg: TrainConfig, steps: int, nproc: int, out_dir: str | Path, tolerance: float | None = None,
           timeout: float | None = None) -> dict[str, Any]:
    """Run SP (nproc ranks) and the SP=1 reference for `steps` steps; return the report (also JSON + PNG)."""
    out = Path(out_dir)
    size = _rows_sp(cfg, nproc)
    if nproc % size != 0:
        raise SeqParError(
            f"--nproc-per-node={nproc} is not a multiple of sequence_parallel.size={size}: use {size} or a multiple"
        )
    dp = nproc // size
    if cfg.stage == "grpo" and dp > 1:  # refused here, before the SP run, not by the reference after it
        raise SeqParError(
            f"seqpar verify of stage: grpo needs dp = 1 (--nproc-per-node={nproc} with sequence_parallel.size="
            f"{size} gives dp={dp}): the SP=1 reference cannot emulate several dp ranks' rollouts; use "
            f"--nproc-per-node {size}"
        )
    check_verify_folder(out)
    base = cfg.model_dump(mode="json")
    # verify owns its sp/ and ref/ folders: each run replaces the previous verify's results there.
    base.update(max_steps=steps, num_epochs=None, checkpoint={"every": 0, "save_final": False, "resume": False},
                overwrite_output_dir=True)
    dropout = without_dropout(cfg, base)
    sp_cfg = config_from_dict({**base, "output_dir": str(out / "sp")})
    # The reference: one process, SP=1 (any max_length valid under SP is valid at SP=1), no FSDP -- except
    # in bf16, where FSDP's fp32 master weights must be mirrored (FSDP2 on a 1-rank group).
    ref_fsdp = bool(cfg.fsdp) and cfg.precision == "bf16"
    ref_cfg = config_from_dict({**base, "output_dir": str(out / "ref"), "fsdp": ref_fsdp,
                                "sequence_parallel": {"size": 1}})
    sp_dump, ref_dump = out / "sp" / "grads_step1.pt", out / "ref" / "grads_step1.pt"
    for f in (sp_dump, ref_dump):
        f.unlink(missing_ok=True)
    _run_sp(sp_cfg, nproc, write_config(sp_cfg, out / "sp_config.yaml"), sp_dump, timeout)
    from .run import train

    write_config(ref_cfg, out / "ref_config.yaml")
    with _env(GRAD_DUMP_ENV, str(ref_dump)):
        train(ref_cfg, emulate_dp=dp)
    return _report(cfg, steps, nproc, dp, out, tolerance, sp_dump, ref_dump, dropout)


def _rows_sp(cfg: TrainConfig, nproc: int) -> int:
    """The SP size a step's rows are counted at (size: dynamic: its largest degree at this world size), so the
    reference plays world / it dp slots: the same rows per step."""
    if not cfg.sequence_parallel.dynamic:
        return cfg.sequence_parallel.size
    from .config import rows_sp_size
    from .model.load import model_info

    info = model_info(cfg)
    return rows_sp_size(cfg, nproc, *info.heads, recurrent=info.recurrent)


def without_dropout(cfg: TrainConfig, base: dict[str, Any]) -> float | None:
    """LoRA dropout draws its masks per rank from the shard it holds, so the SP run and the SP=1 reference drop
    different activations by design: both sides of verify run with dropout 0 (the comparison stays exact), and a
    line says so. Returns the dropout switched off (None: there was none)."""
    p = cfg.finetuning.dropout if cfg.finetuning.method == "lora" else 0.0
    if not p:
        return None
    base["finetuning"] = {**base["finetuning"], "dropout": 0.0}
    print(f"[seqpar verify] finetuning.dropout={p}: dropout draws different masks in the SP run (per shard) and in "
          f"the SP=1 reference, so verify runs both with dropout 0 (training keeps {p})", flush=True)
    return p


def check_verify_folder(out: Path) -> None:
    """verify writes its report and two runs (sp/, ref/, replaced each time) into `out`: refuse a folder that is a
    run's output_dir, is or sits inside a checkpoint or another run's results, or whose sp/ or ref/ holds a run that
    no earlier verify wrote (SeqParError naming the fix)."""
    runs = runs_around(out)
    if runs and runs[0][0] == out.resolve():
        raise SeqParError(f"verify's output folder {out} is {runs[0][1]}: verify writes its report and its sp/ and "
                          f"ref/ runs there; use another folder (--output-dir; default <output_dir>/verify)")
    for sub in ("sp", "ref"):
        refuse_nested_output_dir(out / sub)
        if existing_results(out / sub) and not any((out / f).is_file() for f in VERIFY_FILES):
            raise SeqParError(f"{out / sub} holds a run that `seqpar verify` did not write "
                              f"({', '.join(existing_results(out / sub)[:3])}) and verify would replace it: use "
                              f"another --output-dir")


def _run_sp(sp_cfg: TrainConfig, nproc: int, sp_yaml: Path, sp_dump: Path, timeout: float | None) -> None:
    """The SP run: `seqpar train` under torchrun for several ranks, or in this process for one."""
    if nproc > 1:
        cmd = torchrun_command(nproc, ["train", str(sp_yaml)])
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{GRAD_DUMP_ENV: str(sp_dump)})
        proc = subprocess.run(cmd, env=env, timeout=timeout)
        if proc.returncode != 0:
            raise SeqParError(f"the SP run failed (exit code {proc.returncode}): see its output above")
        return
    from .run import train

    with _env(GRAD_DUMP_ENV, str(sp_dump)):
        train(sp_cfg)


def _report(cfg: TrainConfig, steps: int, nproc: int, dp: int, out: Path, tolerance: float | None, sp_dump: Path,
            ref_dump: Path, dropout_off: float | None = None) -> dict[str, Any]:
    """Losses and gradients of both runs compared: verify.json, verify_loss.png, and the report dict."""
    sp_rows = read_metrics(out / "sp" / "metrics.jsonl")
    ref_rows = read_metrics(out / "ref" / "metrics.jsonl")
    sp_loss = {r["step"]: r["loss"] for r in sp_rows}
    ref_loss = {r["step"]: r["loss"] for r in ref_rows}
    common_steps = sorted(set(sp_loss) & set(ref_loss))
    if len(common_steps) != steps:
        raise SeqParError(f"expected {steps} logged steps from both runs, got SP {len(sp_loss)} / ref {len(ref_loss)}")
    diffs = [abs(sp_loss[s] - ref_loss[s]) for s in common_steps]
    tol = DEFAULT_TOL[cfg.precision] if tolerance is None else tolerance
    grads = compare_gradients(sp_rows, ref_rows, sp_dump, ref_dump, cfg.precision)
    sp = cfg.sequence_parallel
    label_sp = (f"length-aware SP, max_local_tokens {sp.max_local_tokens} ({nproc} ranks)" if sp.dynamic
                else f"SP={sp.size} x dp={dp} ({nproc} ranks)")
    label_ref = f"SP=1 reference (1 process, {dp} dp slot{'s' if dp > 1 else ''})"
    png = plot_curves(
        {label_sp: [(s, sp_loss[s]) for s in common_steps], label_ref: [(s, ref_loss[s]) for s in common_steps]},
        out / "verify_loss.png", title=f"seqpar verify: {cfg.stage} {cfg.finetuning.method} {cfg.model.name}"
        + (f" (LoRA dropout {dropout_off} off in both runs)" if dropout_off else ""),
        diff_of=(label_sp, label_ref), tolerance=tol,
    )
    report = {
        "max_abs_dloss": max(diffs), "tolerance": tol, "loss_passed": max(diffs) <= tol, **grads,
        "passed": max(diffs) <= tol and grads["grads_passed"], "steps": common_steps,
        "sp_loss": [sp_loss[s] for s in common_steps], "ref_loss": [ref_loss[s] for s in common_steps],
        "abs_dloss": diffs, "nproc": nproc, "sp_size": sp.size, "dp_size": dp,
        "sp_mesh": open(out / "sp" / "mesh.txt").read().strip() if (out / "sp" / "mesh.txt").exists() else None,
        "precision": cfg.precision, "stage": cfg.stage, "finetuning": cfg.finetuning.method, "fsdp": bool(cfg.fsdp),
        "packing": cfg.dataset.packing, "png": str(png), "lora_dropout_off": dropout_off,
    }
    (out / "verify.json").write_text(json.dumps(report, indent=2))
    report["json"] = str(out / "verify.json")
    return report


def compare_gradients(sp_rows: list[dict], ref_rows: list[dict], sp_dump: Path, ref_dump: Path,
                      precision: str) -> dict[str, Any]:
    """The gradient part of the verify report: per-step grad-norm and step-1 full-gradient errors."""
    import torch

    for f in (sp_dump, ref_dump):
        if not f.is_file():
            raise SeqParError(f"{f} was not written: the run did not reach the end of step 1")
    sp_gn = {r["step"]: r["grad_norm"] for r in sp_rows}
    ref_gn = {r["step"]: r["grad_norm"] for r in ref_rows}
    steps = sorted(set(sp_gn) & set(ref_gn))
    rel = grad_norm_errors([sp_gn[s] for s in steps], [ref_gn[s] for s in steps])
    dabs, drel = grad_dump_errors(torch.load(sp_dump), torch.load(ref_dump))
    gn_tol, g1_tol = GRAD_NORM_TOL[precision], GRAD_STEP1_TOL[precision]
    g1 = dabs if precision == "fp32" else drel  # bf16: relative to max |g_ref|
    return {
        "max_rel_dgrad_norm": max(rel),
        "grad_norm_tolerance": gn_tol,
        "sp_grad_norm": [sp_gn[s] for s in steps],
        "ref_grad_norm": [ref_gn[s] for s in steps],
        "max_abs_dgrad_step1": dabs,
        "max_rel_dgrad_step1": drel,
        "grad_step1_measure": "max_abs_dgrad_step1" if precision == "fp32" else "max_rel_dgrad_step1",
        "grad_step1_tolerance": g1_tol,
        "grads_passed": max(rel) <= gn_tol and g1 <= g1_tol,
    }
