"""Never lose a run: what `seqpar train` does with an existing output_dir, and ranks that outlive a launcher.

- A killed launcher (kill -9) takes its ranks down within seconds; while any of them lives, the folder
  stays locked (every process of the run holds the lock file); afterwards a new run may take the folder.
- A fresh start over a finished run's results is refused, naming them, unless overwrite_output_dir.
- A dangling `latest` resumes from the newest complete checkpoint, with a line; never a fresh start.
- With checkpointing on, the last step is checkpointed; resuming a complete run says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from procs import run_command, spawned, write_sft_rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sft_rows(tmp_path_factory.mktemp("outdir"))


def _yaml(data: Path, out: Path, name: str = "cfg.yaml", **over) -> str:
    cfg = {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 1}},
           "dataset": {"path": str(data / "sft.jsonl"), "max_length": 64}, "micro_batch_size": 2, "max_steps": 2,
           "optimizer": {"lr": 1e-2}, "output_dir": str(out), "progress": False, "memory": {"measure": False}}
    cfg.update(over)
    path = out.parent / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _seqpar(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_command([sys.executable, "-m", "seqpar", *args], env=env, timeout=timeout)


def _steps(out: Path) -> list[int]:
    p = out / "metrics.jsonl"
    return [json.loads(x)["step"] for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []


def test_fresh_run_over_results_refused_unless_overwrite(data, tmp_path):
    out = tmp_path / "run"
    y = _yaml(data, out)
    assert _seqpar("train", y).returncode == 0
    before = (out / "metrics.jsonl").read_text()
    r = _seqpar("train", y, "--set", "optimizer.lr=0.02")  # default checkpoint.every 0: nothing to resume
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    for name in ("metrics.jsonl (2 steps)", "final/", "config.json", "loss.png", "--overwrite"):
        assert name in err, err
    assert (out / "metrics.jsonl").read_text() == before  # nothing touched
    r = _seqpar("train", y, "--set", "optimizer.lr=0.02", "--max-steps", "3", "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "removed the earlier run's" in r.stdout
    assert _steps(out) == [1, 2, 3] and json.loads((out / "config.json").read_text())["optimizer"]["lr"] == 0.02


def test_last_step_checkpointed_dangling_latest_and_complete_run(data, tmp_path):
    out = tmp_path / "run"
    y = _yaml(data, out, max_steps=4, checkpoint={"every": 2, "keep_last": 3})
    assert _seqpar("train", y).returncode == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    # every: 3 with max_steps 3 used to leave nothing to resume or export from.
    y3 = _yaml(data, tmp_path / "three", "three.yaml", max_steps=3, checkpoint={"every": 3})
    assert _seqpar("train", y3).returncode == 0
    assert (tmp_path / "three" / "latest").read_text().strip() == "checkpoint-3"
    # Complete: a rerun says so and trains nothing.
    r = _seqpar("train", y)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already complete" in r.stdout and "raise max_steps" in r.stdout and _steps(out) == [1, 2, 3, 4]
    # A dangling `latest` falls back to the newest complete checkpoint (and says so) instead of step 0.
    (out / "latest").write_text("checkpoint-99")
    r = _seqpar("train", y, "--max-steps", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "names checkpoint-99, which is missing or incomplete" in r.stdout and "resuming from step 4" in r.stdout
    assert _steps(out) == [1, 2, 3, 4, 5, 6]
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir() and (out / "checkpoint-6").is_dir()


def test_lock_of_a_dead_owner_is_kept_while_its_processes_live(tmp_path):
    from seqpar.errors import SeqParError
    from seqpar.train.lifecycle.lock import LOCK_NAME, OutputDirLock

    with spawned([sys.executable, "-c", "pass"]) as dead:
        dead.wait(timeout=60)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "run_id": "old"}))
    with spawned([sys.executable, "-c", (
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(tmp_path / LOCK_NAME)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH)\n"
            "print('held', flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SeqParError, match="still hold"):
            OutputDirLock(tmp_path, run_id="new").acquire()
    lock = OutputDirLock(tmp_path, run_id="new")
    lock.acquire()  # the owner and every holder are gone: stale, replaced
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == "new"
    lock.release()


def _children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _alive(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_kill9_launcher_takes_its_ranks_down(data, tmp_path):
    out = tmp_path / "run"
    y = _yaml(data, out, max_steps=100000, sequence_parallel={"size": 2}, export={"final": False})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with spawned([sys.executable, "-m", "seqpar", "train", y, "--nproc-per-node", "2"], env=env,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as launcher:  # killed, with its ranks, at exit
        deadline = time.time() + 240
        while len(_steps(out)) < 2:
            assert launcher.poll() is None and time.time() < deadline, "the run did not start training"
            time.sleep(0.5)
        ranks = _children(launcher.pid)
        assert len(ranks) >= 2, ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 30
        while _alive(ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(ranks), "ranks kept running after their launcher was killed"
        n = len(_steps(out))
        time.sleep(2)
        assert len(_steps(out)) == n  # nobody writes into the folder any more
    # The dead run's lock is stale now; its results are still protected from a fresh start.
    r = _seqpar("train", y, "--max-steps", "2", "--nproc-per-node", "2")
    assert r.returncode == 2 and "already holds a run's results" in r.stderr, r.stderr[-2000:]


def _train_here(data: Path, out: Path, **over):
    from seqpar.train.config import load_config
    from seqpar.train.run import train

    return train(load_config(_yaml(data, out, **over)))


def test_damaged_checkpoint_falls_back_to_an_intact_one(data, tmp_path, capsys):
    out = tmp_path / "run"
    _train_here(data, out, max_steps=3, checkpoint={"every": 1, "keep_last": 2})
    shard = max((out / "checkpoint-3").glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk or an interrupted copy
    capsys.readouterr()
    res = _train_here(data, out, max_steps=4, checkpoint={"every": 1, "keep_last": 2})
    said = capsys.readouterr().out
    assert f"{out / 'checkpoint-3'} is damaged ({shard.name} is truncated" in said, said
    assert "resuming from the newest intact checkpoint" in said and res.resumed_from == 2 and res.steps == [3, 4]


def test_disk_full_while_checkpointing_names_the_good_checkpoint(data, tmp_path, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp

    from seqpar.errors import SeqParError

    real, calls = dcp.save, []

    def save(*a, **k):  # the second save hits a full disk
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(dcp, "save", save)
    out = tmp_path / "run"
    with pytest.raises(SeqParError) as e:
        _train_here(data, out, max_steps=3, checkpoint={"every": 1})
    msg = str(e.value)
    good = out / "checkpoint-1"
    assert msg.startswith(f"no space left on {out} while saving checkpoint-2: {good} is the last good"), msg
    assert not (out / "checkpoint-2").exists() and (out / "latest").read_text().strip() == "checkpoint-1"


def _disk_full_on_last_rank(cfg_path: str) -> str:
    """One rank of a 2-rank run whose last rank's disk is full at the second checkpoint save: DCP's own writer
    fails there, and DCP raises its CheckpointException (a BaseException) on every rank."""
    import errno

    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from seqpar.errors import SeqParError
    from seqpar.train.config import load_config
    from seqpar.train.run import train

    real, calls = FileSystemWriter.write_data, []

    def write_data(self, *a, **k):
        calls.append(1)
        if len(calls) == 2 and dist.get_rank() == dist.get_world_size() - 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    FileSystemWriter.write_data = write_data
    try:
        train(load_config(cfg_path))
    except SeqParError as e:
        return str(e)
    return "no error"


def test_disk_full_while_checkpointing_on_two_ranks(data, tmp_path):
    """The same on 2 ranks through DCP's real save: one line on every rank, the partial checkpoint removed."""
    from seqpar.spawn import run_distributed

    out = tmp_path / "run"
    cfg = _yaml(data, out, max_steps=3, checkpoint={"every": 1}, sequence_parallel={"size": 2})
    msgs = run_distributed(_disk_full_on_last_rank, 2, cfg, timeout=300)
    good = out / "checkpoint-1"
    for msg in msgs:
        assert msg.startswith(f"no space left on {out} while saving checkpoint-2: {good} is the last good"), msg
        assert "\n" not in msg, msg
    assert not (out / "checkpoint-2").exists() and (out / "latest").read_text().strip() == "checkpoint-1"


def test_start_line_without_progress_bar(data, tmp_path, capsys):
    """progress: false still prints one start line: stage, mesh, data, steps, features, the resume point."""
    _train_here(data, tmp_path / "run", max_steps=1, finetuning={"method": "lora", "r": 2},
                memory={"activation_checkpointing": True})
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[seqpar] sft fp32: "))
    for part in ("SequenceParallelMesh", "world 1", "8 examples", "1 steps from step 0", "lora",
                 "activation_checkpointing", "memory.measure"):
        assert part in line, line


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    """--overwrite clears a run's results: checkpoint-<N> folders, not any folder whose name starts so."""
    from seqpar.train.lifecycle.output_dir import clear_results, existing_results

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-notes").mkdir()
    (tmp_path / "checkpoint-notes" / "todo.txt").write_text("mine")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert existing_results(tmp_path) == ["metrics.jsonl (1 steps)", "checkpoint-3/"]
    clear_results(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-notes"]


def test_runs_never_nest_where_another_run_deletes(data, tmp_path, capsys):
    """A run's output_dir inside a checkpoint or another run's final/ is refused (that run's rotation, export or
    --overwrite would delete it); verify's output folder may not be a run, a checkpoint, or hold a run in sp/ that
    no verify wrote (verify replaces sp/ and ref/)."""
    from seqpar.cli.main import main
    from seqpar.errors import SeqParError

    run = tmp_path / "run"
    _train_here(data, run, max_steps=1, checkpoint={"every": 1})
    for inside, says in ((run / "checkpoint-1" / "sub", f"is inside {run / 'checkpoint-1'}, a checkpoint"),
                         (run / "final" / "r", f"is inside {run / 'final'}, which the run in {run}")):
        with pytest.raises(SeqParError, match="^output_dir .*" + says.replace("(", r"\(")):
            _train_here(data, inside, max_steps=1)
        assert not inside.exists()
    y = _yaml(data, tmp_path / "other")
    foreign = tmp_path / "v"
    (foreign / "sp").mkdir(parents=True)
    (foreign / "sp" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    for out, says in ((run, "is a run's output_dir"), (run / "checkpoint-1", "a checkpoint"),
                      (foreign, "holds a run that `seqpar verify` did not write")):
        capsys.readouterr()
        assert main(["verify", y, "--nproc-per-node", "1", "--steps", "1", "--output-dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert (foreign / "sp" / "metrics.jsonl").is_file() and not (run / "sp").exists()
