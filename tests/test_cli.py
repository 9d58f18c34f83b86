"""The CLI end to end: `seqpar verify` (torchrun SP run vs SP=1 reference -> PNG + JSON) and
kill-a-rank / torchrun restart / resume giving the same final parameters as an uninterrupted run."""

from __future__ import annotations

import json
import math
import os
import random
import sys

import pytest
import torch
import yaml
from procs import phrase, run_command


def _write_config(tmp_path, name, stage="sft", **over):
    rng = random.Random(1)
    data = tmp_path / f"{stage}.jsonl"
    with open(data, "w") as f:
        for _ in range(16):
            row = ({"prompt": phrase(rng, 1, 5), "chosen": phrase(rng, 1, 6), "rejected": phrase(rng, 2, 8)}
                   if stage == "dpo" else {"instruction": phrase(rng, 1, 6), "response": phrase(rng, 2, 10)})
            f.write(json.dumps(row) + "\n")
    cfg = {
        "model": {"name": "tiny:qwen3", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(data), "max_length": 128},
        "stage": stage,
        "sequence_parallel": {"size": 2},
        "micro_batch_size": 2,
        "grad_accum": 2,
        "max_steps": 5,
        "optimizer": {"lr": 1e-2},
        "output_dir": str(tmp_path / name),
        "progress": False,
    }
    for k, v in over.items():
        cfg[k] = v
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _seqpar(*args, env=None, timeout=400):
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    r = run_command([sys.executable, "-m", "seqpar", *args], env=e, timeout=timeout)
    return r


def _verify(tmp_path, name, stage, nproc, tol=1e-5, grad_tol=(1e-4, 1e-5), env=None, expect_pass=True, steps=5,
            **over):
    """grad_tol: (relative per-step grad-norm error, step-1 gradient error: abs for fp32, relative for bf16)."""
    cfg = _write_config(tmp_path, name, stage, **over)
    out = tmp_path / f"{name}_verify"
    r = _seqpar("verify", str(cfg), "--steps", str(steps), "--nproc-per-node", str(nproc), "--output-dir", str(out),
                env=env)
    rep = json.loads((out / "verify.json").read_text())
    g1 = rep[rep["grad_step1_measure"]]
    print(f"{name}: max |dloss| = {rep['max_abs_dloss']:.2e}, max rel dgrad_norm = {rep['max_rel_dgrad_norm']:.2e}, "
          f"step-1 {rep['grad_step1_measure']} = {g1:.2e}")
    if not expect_pass:
        assert r.returncode == 1 and "FAIL" in r.stdout and not rep["passed"], r.stdout[-3000:] + r.stderr[-3000:]
        return rep
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (out / "verify_loss.png").stat().st_size > 10_000
    assert rep["passed"] and rep["max_abs_dloss"] <= tol and len(rep["steps"]) == steps, rep
    assert rep["grads_passed"] and rep["max_rel_dgrad_norm"] <= grad_tol[0] and g1 <= grad_tol[1], rep
    assert min(rep["ref_grad_norm"]) > 0 and math.isfinite(rep["max_abs_dgrad_step1"])
    assert "PASS" in r.stdout and str(out / "verify_loss.png") in r.stdout
    row = json.loads((out / "sp" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("loss", "lr", "grad_norm", "tokens", "supervised", "tokens_per_s", "step_cpu_s", "peak_mem_mb",
                "peak_alloc_mb"):
        assert key in row and row[key] > 0, (key, row)
    assert (out / "sp" / "loss.png").stat().st_size > 5_000
    return rep


def test_cli_verify_sft_packed(tmp_path):
    """seqpar verify: SFT, packing, full fine-tuning, SP=2 ring (qwen3) on 2 torchrun ranks."""
    _verify(tmp_path, "sft", "sft", 2, micro_batch_size=1,
            dataset={"path": str(tmp_path / "sft.jsonl"), "max_length": 128, "packing": True},
            sequence_parallel={"size": 2, "ring_degree": 2})


@pytest.mark.slow
def test_cli_verify_fails_on_injected_gradient_scale_fault(tmp_path):
    """The SP run's gradients are scaled by dp x sp = 2 (test-only env fault, SP side only): with AdamW the
    loss curves still agree to ~1e-6, but the gradient checks of verify catch it and it FAILS (exit 1)."""
    rep = _verify(tmp_path, "fault", "sft", 2, env={"SEQPAR_FAULT_GRAD_SCALE": "2"}, expect_pass=False)
    assert not rep["grads_passed"] and rep["max_rel_dgrad_norm"] > 0.9, rep


def test_cli_verify_fails_on_injected_gradient_scale_fault_fast(tmp_path):
    """Fast twin of the test above: 2 steps of a 1-layer model, the same fault, verify FAILS (exit 1) on the
    gradients alone (the AdamW losses agree)."""
    model = {"name": "tiny:qwen3", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 1}}
    rep = _verify(tmp_path, "fault", "sft", 2, env={"SEQPAR_FAULT_GRAD_SCALE": "2"}, expect_pass=False, steps=2,
                  model=model, max_steps=2)
    assert not rep["grads_passed"] and rep["max_rel_dgrad_norm"] > 0.9, rep


def test_verify_lora_dropout_runs_both_sides_without_it(tmp_path):
    """LoRA dropout 0.1 draws different masks per shard and in the reference (verify FAILED with |dloss| ~2e-3,
    without a word): verify says so and runs both sides with dropout 0, which passes; verify.json records it."""
    cfg = _write_config(tmp_path, "drop", max_steps=2, finetuning={"method": "lora", "r": 4, "alpha": 8,
                                                                   "dropout": 0.1})
    out = tmp_path / "drop_verify"
    r = _seqpar("verify", str(cfg), "--steps", "2", "--nproc-per-node", "2", "--output-dir", str(out))
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "finetuning.dropout=0.1: dropout draws different masks" in r.stdout, r.stdout[-3000:]
    rep = json.loads((out / "verify.json").read_text())
    assert rep["lora_dropout_off"] == 0.1 and rep["passed"], rep
    assert yaml.safe_load((out / "sp_config.yaml").read_text())["finetuning"]["dropout"] == 0.0


def test_verify_plot_says_exact_zero_and_draws_the_tolerance(tmp_path):
    """The |dloss| panel: a dashed line at the tolerance; exact zeros are marked points at the bottom of the log
    axis and the title says so (they were drawn at 1e-12 without a word)."""
    from seqpar.train.loop.plots import curves_figure, diff_title, plot_curves

    same = {"sp": [(1, 2.0), (2, 1.5), (3, 1.2)], "ref": [(1, 2.0), (2, 1.5), (3, 1.2)]}
    fig = curves_figure(same, diff_of=("sp", "ref"), tolerance=1e-5)
    ax = fig.axes[1]
    labels = [line.get_label() for line in ax.get_lines()]
    assert "tolerance 1e-05" in labels and "exactly 0 (no difference)" in labels, labels
    assert ax.get_title() == "|dloss| = 0 exactly at every step (identical losses); tolerance 1e-05"
    zero = next(line for line in ax.get_lines() if line.get_label().startswith("exactly 0"))
    assert max(zero.get_ydata()) < 1e-5 and min(zero.get_ydata()) > ax.get_ylim()[0]
    assert diff_title([0.0, 3e-7, 1e-7], 1e-5) == ("max |dloss| = 3.00e-07; exactly 0 at 1 of 3 steps (marked at the "
                                                    "bottom); tolerance 1e-05")
    assert plot_curves(same, tmp_path / "v.png", diff_of=("sp", "ref"), tolerance=1e-5).stat().st_size > 10_000


def test_verify_gradient_comparison_fails_on_a_scale_error(tmp_path):
    """Unit test of verify's gradient comparison: a x4 (dp x sp) scale on the SP side fails it; equal passes."""
    from seqpar.train.verify import compare_gradients

    g = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(3)}
    rows = [{"step": s, "grad_norm": 1.5 + s} for s in (1, 2, 3)]
    torch.save(g, tmp_path / "ref.pt")
    torch.save(g, tmp_path / "same.pt")
    torch.save({k: 4 * v for k, v in g.items()}, tmp_path / "x4.pt")
    ok = compare_gradients(rows, rows, tmp_path / "same.pt", tmp_path / "ref.pt", "fp32")
    assert ok["grads_passed"] and ok["max_abs_dgrad_step1"] == 0.0 and ok["max_rel_dgrad_norm"] == 0.0
    x4_rows = [dict(r, grad_norm=4 * r["grad_norm"]) for r in rows]
    bad = compare_gradients(x4_rows, rows, tmp_path / "x4.pt", tmp_path / "ref.pt", "fp32")
    assert not bad["grads_passed"] and abs(bad["max_rel_dgrad_norm"] - 3.0) < 1e-9
    assert bad["max_abs_dgrad_step1"] > 1e-5
    # Either check alone fails it: right norms but a wrong step-1 gradient, and the reverse.
    assert not compare_gradients(rows, rows, tmp_path / "x4.pt", tmp_path / "ref.pt", "fp32")["grads_passed"]
    assert not compare_gradients(x4_rows, rows, tmp_path / "same.pt", tmp_path / "ref.pt", "fp32")["grads_passed"]


@pytest.mark.slow
def test_cli_verify_dpo_lora_fsdp(tmp_path):
    """seqpar verify: DPO + LoRA + FSDP2, USP 2x2 on 4 torchrun ranks."""
    _verify(tmp_path, "dpo", "dpo", 4, fsdp=True, sequence_parallel={"size": 4, "ulysses_degree": 2},
            finetuning={"method": "lora", "r": 4, "alpha": 8})


@pytest.mark.slow
def test_cli_verify_bf16(tmp_path):
    """bf16 (FSDP2 mixed precision: fp32 master weights) SP=2 vs the bf16 SP=1 reference; bar 5e-2."""
    _verify(tmp_path, "bf16", "sft", 2, tol=5e-2, grad_tol=(5e-2, 5e-2), precision="bf16", fsdp=True)


@pytest.mark.slow
def test_cli_verify_bf16_master_weights_nofsdp(tmp_path):
    """bf16 without FSDP (bf16 weights + fp32 masters, model/precision.py) SP=2 vs the SP=1 reference; bar 5e-2."""
    _verify(tmp_path, "bf16m", "sft", 2, tol=5e-2, grad_tol=(5e-2, 5e-2), precision="bf16")


@pytest.mark.parametrize("variant", ["full_fsdp", pytest.param("lora_nofsdp", marks=pytest.mark.slow)])
def test_kill_rank_restart_resume_equals_uninterrupted(tmp_path, variant):
    """A rank dies after step 3 (fault hook); torchrun restarts all ranks (up to 3 rounds: a restart round
    can itself fail to rendezvous on a loaded machine -- gloo "connectFullMesh ... Connection refused");
    they resume from the step-2
    checkpoint (model, optimizer, scheduler, sampler position, RNG). Final parameters must equal an
    uninterrupted run's exactly (same world, same config: deterministic CPU math)."""
    ck = {"every": 2, "save_final": True, "keep_last": 2}
    extra = ({"fsdp": True} if variant == "full_fsdp"
             else {"finetuning": {"method": "lora", "r": 4, "alpha": 8}, "schedule": {"name": "cosine"}})
    base = _write_config(tmp_path, "uninterrupted", checkpoint=ck, **extra)
    r = _seqpar("train", str(base), "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    faulty = _write_config(tmp_path, "faulty", checkpoint=ck, **extra)
    r = _seqpar("train", str(faulty), "--nproc-per-node", "2", "--max-restarts", "3",
                env={"SEQPAR_FAULT_AFTER_STEP": "3"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fault hook: rank 1 exits after step 3" in r.stdout + r.stderr
    a = torch.load(tmp_path / "uninterrupted" / "final_state.pt")
    b = torch.load(tmp_path / "faulty" / "final_state.pt")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The resumed run logged steps 3..5 again after the restart; its metrics end with the same losses.
    la = [json.loads(x)["loss"] for x in (tmp_path / "uninterrupted" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    assert la == lb and len(la) == 5
    assert (tmp_path / "faulty" / "latest").read_text().strip() == "checkpoint-5"  # the last step is checkpointed
