"""Elastic restarts: `seqpar train --nnodes MIN:MAX` goes on after losing a node, on the new world size.

Two "nodes" on this machine (two `seqpar train` launchers of 2 processes each, c10d rendezvous on 127.0.0.1,
one shared output_dir): SFT at SP 2 with global_batch_size 4, so the run starts at world 4 (dp 2 x sp 2,
grad_accum 2). When checkpoint-2 is complete, node 1 is killed (its launcher and its ranks, SIGKILL: a lost
node). Node 0's ranks fail in their next collective, its agent restarts them (a --max-restarts attempt) on the
one node left, and they resume from the last complete checkpoint at world 2 (dp 1 x sp 2, grad_accum 4: the
same global batch), with no one stepping in. Compared with one uninterrupted one-process SP = 1 run: every
step's loss and gradient norm (relative above 1), and the final parameters, within 1e-5 (fp32, AdamW lr 1e-3).
Every process has a deadline and is killed on every path.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from procs import communicate, run_command, spawned, write_sft_rows

from seqpar.errors import SeqParError
from seqpar.spawn import free_port
from seqpar.train.lifecycle.nodes import NodeLaunch, resolve_nodes

TOL = 1e-5
# The restart waits last_call_timeout (torch: 30 s) for more nodes once node 0 is there: 8 s here, still well past
# the second launcher's start at the beginning (0.5 s after the first).
RDZV_CONF = "last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=3"


def _descendants(pid: int) -> list[int]:
    """pid's child processes, recursively (from /proc; torch's elastic agent starts ranks in new sessions)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _kill_node(proc: subprocess.Popen) -> None:
    """A lost node: the launcher and every process under it die at once."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _cfg(data: Path, out: Path) -> dict:
    return {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
            "dataset": {"path": str(data / "sft.jsonl"), "max_length": 64}, "sequence_parallel": 2,
            "micro_batch_size": 1, "global_batch_size": 4, "max_steps": 8, "optimizer": {"lr": 1e-3},
            "schedule": {"name": "constant", "warmup_steps": 3}, "checkpoint": {"every": 2, "save_final": True},
            "export": {"final": False}, "memory": {"measure": False}, "timeout_minutes": 2, "progress": False,
            "output_dir": str(out)}


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_elastic_node_range():
    """--nnodes MIN:MAX: the torchrun form, every world size it may run at, refusals that name the fix."""
    n = resolve_nodes(2, "1:2", 1, "127.0.0.1:29400", env={})
    assert n.elastic and n.world == 4 and n.worlds == [2, 4] and n.min_nodes == 1
    assert "--nnodes=1:2" in n.torchrun_args(3, "x") and "--max-restarts=3" in n.torchrun_args(3, "x")
    assert "of 1..2 (elastic" in n.describe()
    assert resolve_nodes(2, "2", 0, "h:1", env={}) == NodeLaunch(2, 2, 0, "h:1", "seqpar-h:1")
    assert not resolve_nodes(2, "1:1", env={}).multi_node
    for bad in ("2:1", "0:2", "a:b", "1:2:3"):
        with pytest.raises(Exception, match="--nnodes"):
            resolve_nodes(2, bad, 0, "h:1", env={})


def test_rdzv_conf_reaches_torchrun_and_bad_keys_are_refused():
    """--rdzv-conf: torch ignores a key it does not know (a typo would change nothing), so seqpar refuses it."""
    n = resolve_nodes(2, "1:2", 1, "h:1", env={}, rdzv_conf="last_call_timeout=8, keep_alive_interval=1")
    assert "--rdzv-conf=is_host=false,last_call_timeout=8,keep_alive_interval=1" in n.torchrun_args(3, "x")
    assert "--rdzv-conf=is_host=true" in resolve_nodes(2, "2", 0, "h:1", env={}).torchrun_args(0, "x")
    for bad, needle in (("last_call=8", "KEY one of join_timeout"), ("is_host=true", "seqpar sets it"),
                        ("join_timeout=-1", "positive whole number"), ("join_timeout", "positive whole number"),
                        ("timeout=1.5", "positive whole number")):
        with pytest.raises(SeqParError, match=needle):
            resolve_nodes(2, "1:2", 0, "h:1", env={}, rdzv_conf=bad)
    with pytest.raises(SeqParError, match="--rdzv-conf only apply to a launch over several nodes"):
        resolve_nodes(2, None, env={}, rdzv_conf="join_timeout=60")


def test_elastic_launch_checks_every_world(tmp_path):
    """SP 4 over nodes of 2 processes cannot go on with one node: refused before launch (exit 2), naming it."""
    data = write_sft_rows(tmp_path)
    cfg = dict(_cfg(data, tmp_path / "out"), sequence_parallel=4)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    r = run_command([sys.executable, "-m", "seqpar", "train", str(tmp_path / "cfg.yaml"), "--nproc-per-node", "2",
                     "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"], timeout=300,
                    env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "may restart at world size 2 after losing nodes" in r.stderr, r.stderr[-3000:]
    assert "sequence_parallel.size=4 does not divide the world size 2" in r.stderr, r.stderr[-3000:]


def test_elastic_restart_after_a_lost_node(tmp_path):
    data = write_sft_rows(tmp_path)
    out = tmp_path / "shared_out"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(_cfg(data, out)))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with contextlib.ExitStack() as stack:  # both nodes (launcher and ranks) killed on every way out
        nodes = []
        for node in (0, 1):
            cwd = tmp_path / f"node{node}"
            cwd.mkdir()
            cmd = [sys.executable, "-m", "seqpar", "train", str(cfg), "--nproc-per-node", "2", "--nnodes", "1:2",
                   "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "2",
                   "--rdzv-conf", RDZV_CONF]
            nodes.append(stack.enter_context(spawned(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, text=True)))
            time.sleep(0.5)
        deadline = time.time() + 400
        while not (out / "latest").is_file() and time.time() < deadline and nodes[0].poll() is None:
            time.sleep(0.05)
        assert (out / "latest").is_file(), "no checkpoint appeared"
        assert "world=4" in (out / "mesh.txt").read_text()
        _kill_node(nodes[1])
        lost_at = time.time()
        stdout, stderr = communicate(nodes[0], timeout=max(10.0, deadline + 200 - time.time()))
    assert nodes[0].returncode == 0, stdout[-3000:] + stderr[-4000:]
    print(f"node 0 went on alone and finished {time.time() - lost_at:.0f} s after node 1 was lost")
    assert "[seqpar] resuming from step" in stdout and "this run is world 2 (dp 1 x sp 2" in stdout, stdout[-3000:]
    assert "global batch kept: 4 examples per step (dp 2 x micro_batch_size 1 x grad_accum 2 -> dp 1 x " \
           "micro_batch_size 1 x grad_accum 4)" in stdout, stdout[-3000:]
    assert "world=2" in (out / "mesh.txt").read_text()
    _compare_with_one_process(cfg, out, tmp_path / "ref")


def _compare_with_one_process(cfg: Path, out: Path, ref: Path) -> None:
    r = run_command([sys.executable, "-m", "seqpar", "train", str(cfg), "--output-dir", str(ref), "--set",
                     "sequence_parallel=1"], timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _rows(out), _rows(ref)
    assert [x["step"] for x in got] == [x["step"] for x in want] == list(range(1, 9))
    dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want))
    dgn = max(abs(a["grad_norm"] - b["grad_norm"]) / max(1.0, b["grad_norm"]) for a, b in zip(got, want))
    s, t = torch.load(out / "final_state.pt"), torch.load(ref / "final_state.pt")
    dparam = max(float((s[k] - t[k]).abs().max()) for k in t)
    print(f"elastic run vs one process: max |dloss| {dloss:.2e}, max rel |dgrad_norm| {dgn:.2e}, "
          f"max |dparam| {dparam:.2e}")
    assert dloss <= TOL and dgn <= TOL and dparam <= TOL, (dloss, dgn, dparam)
