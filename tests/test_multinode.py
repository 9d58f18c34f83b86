"""Several nodes and collective timeouts.

- Launch arguments from the command line and from SLURM's variables (env dicts, no SLURM needed).
- Node-size-aware degrees: an automatic Ulysses degree divides the processes per node; explicit degrees
  that would put a Ulysses group across nodes get a warning naming the fix.
- One timeout reaches every process group seqpar creates (init_process_group, every mesh subgroup, the FSDP2
  mesh): a collective on an SP subgroup whose peer never arrives fails after that timeout, not 30 minutes.
- Two "nodes" on this machine (two launches of 2 processes, c10d rendezvous on 127.0.0.1): SFT with FSDP2 and
  one checkpoint/resume gives the losses and gradient norms of a one-process run (1e-5); with output_dir
  on node-local folders, checkpoints are refused and rank 0's node alone writes the results.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from procs import communicate, run_command, spawned, write_sft_rows

from seqpar.errors import SeqParError
from seqpar.spawn import free_port
from seqpar.train.lifecycle.nodes import NodeLaunch, first_slurm_host, resolve_nodes

# An srun step over 2 nodes, one task per node, as seen on the second node.
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_STEP_NUM_TASKS": "2", "SLURM_GPUS_ON_NODE": "4"}


def _err(fn, *parts):
    with pytest.raises(SeqParError) as e:
        fn()
    for p in parts:
        assert p in str(e.value), str(e.value)


def test_launch_arguments_from_flags_and_slurm():
    # One node: as before (a private rendezvous on a free local port); flags for several nodes are refused.
    one = resolve_nodes(4, env={})
    assert one == NodeLaunch(4) and one.world == 4 and not one.multi_node
    assert one.torchrun_args(1, "abc") == ["--nproc-per-node=4", "--max-restarts=1", "--rdzv-backend=c10d",
                                           "--rdzv-endpoint=localhost:0", "--rdzv-id=abc", "-m", "seqpar"]
    _err(lambda: resolve_nodes(4, node_rank=1, env={}), "--node-rank", "add --nnodes N")
    # Several nodes from the command line.
    two = resolve_nodes(2, 2, 1, "10.0.0.1:29400", env={})
    assert (two.world, two.node_rank, two.rdzv_id, two.source) == (4, 1, "seqpar-10.0.0.1:29400", "command line")
    args = two.torchrun_args(2, "ignored")
    assert args == ["--nproc-per-node=2", "--max-restarts=2", "--rdzv-backend=c10d", "--nnodes=2",
                    "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=seqpar-10.0.0.1:29400", "--rdzv-conf=is_host=false",
                    "-m", "seqpar"]
    assert "--rdzv-conf=is_host=true" in resolve_nodes(2, 2, 0, "h:1", env={}).torchrun_args(0, "x")
    assert resolve_nodes(2, 2, env={"MASTER_ADDR": "m", "MASTER_PORT": "1234"}).rdzv_endpoint == "m:1234"
    _err(lambda: resolve_nodes(2, 2, env={}), "needs --rdzv-endpoint HOST:PORT")
    _err(lambda: resolve_nodes(2, 2, 2, "h:1", env={}), "--node-rank 2 is not a node of --nnodes 2", "0 .. 1")
    _err(lambda: resolve_nodes(2, 2, 0, "h", env={}), "HOST:PORT")
    _err(lambda: resolve_nodes(None, 2, 0, "h:1", env={}), "--nproc-per-node")
    # SLURM: every value from its variables; the command line wins where given.
    s = resolve_nodes(env=SLURM)
    assert (s.nproc_per_node, s.nnodes, s.node_rank, s.rdzv_endpoint, s.rdzv_id, s.source) == \
        (4, 2, 1, "gpu007:29500", "slurm-4242", "SLURM")
    s = resolve_nodes(2, rdzv_endpoint="x:9", env={**SLURM, "SLURM_STEP_ID": "3"})
    assert (s.nproc_per_node, s.rdzv_endpoint, s.rdzv_id) == (2, "x:9", "slurm-4242.3")
    assert resolve_nodes(env={**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "7"}).rdzv_endpoint == "head:7"
    _err(lambda: resolve_nodes(env={**SLURM, "SLURM_STEP_NUM_TASKS": "8"}), "8 tasks on 2 nodes",
         "--ntasks-per-node=1")
    # A one-node step, the batch script itself (no srun step: it runs on the first node only), or --nnodes 1:
    # a one-node launch whatever the allocation.
    assert not resolve_nodes(2, env={**SLURM, "SLURM_STEP_NUM_NODES": "1"}).multi_node
    batch = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP_")}
    assert not resolve_nodes(2, env=batch).multi_node
    assert not resolve_nodes(2, 1, env=SLURM).multi_node
    # ... unless --nnodes says otherwise there: the rest still comes from SLURM.
    b = resolve_nodes(2, 2, env={**batch, "SLURM_NODEID": "0"})
    assert (b.node_rank, b.rdzv_endpoint, b.rdzv_id) == (0, "gpu007:29500", "slurm-4242")
    assert [first_slurm_host(x) for x in ("n1", "n[3-4],m2", "a[01,7]-ib[2-3]", "x1,y[1-2]")] == \
        ["n1", "n3", "a01-ib2", "x1"]


def test_node_size_aware_degrees(monkeypatch):
    from seqpar.mesh import RecurrentHeads, auto_degrees, node_size_from_env, spans_nodes_message
    from seqpar.train.config import config_from_dict, validate_for_launch

    assert auto_degrees(8, 8, 8) == (8, 1)
    assert auto_degrees(8, 8, 8, node_size=4) == (4, 2)  # a Ulysses group never spans two nodes of 4
    assert auto_degrees(8, 8, 8, node_size=6) == (2, 4)  # ... nor straddles a node boundary (6 % 4 != 0)
    assert auto_degrees(8, 8, 8, node_size=1) == (1, 8)
    # hybrids: the recurrent layers' heads bound Ulysses too, the rest is ring (state passing); the node still does
    assert auto_degrees(8, 8, 8, recurrent=RecurrentHeads("gated_deltanet", 2), node_size=4) == (2, 4)
    assert auto_degrees(8, 8, 8, recurrent=RecurrentHeads("gated_deltanet", 16), node_size=4) == (4, 2)
    assert spans_nodes_message(4, 2, 8) is None and spans_nodes_message(4, 2, 4) is None
    msg = spans_nodes_message(4, 1, 2)
    assert "ulysses_degree=4 does not divide the 2 processes per node" in msg
    assert "set ulysses_degree=2 and ring_degree=2" in msg
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_size_from_env(8) == 2 and node_size_from_env(3) == 3  # 2 does not divide 3: no placement
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert node_size_from_env(8) == 8
    cfg = config_from_dict({"model": "tiny:llama", "dataset": {"path": "x.jsonl", "max_length": 64},
                            "sequence_parallel": 4})
    assert validate_for_launch(cfg, 4, num_heads=4, num_kv_heads=4) == (4, 1)
    assert validate_for_launch(cfg, 4, num_heads=4, num_kv_heads=4, node_size=2) == (2, 2)
    assert cfg.timeout_minutes == 30 and cfg.collective_timeout.total_seconds() == 1800


# ----------------------------------------------------------------------------- collective timeouts
HANG = textwrap.dedent("""
    import datetime, json, os, sys, time, warnings
    import torch, torch.distributed as dist
    from seqpar.mesh import init_mesh
    from seqpar.train.lifecycle.process import init_process_group
    from seqpar.train.model.build import apply_fsdp
    from seqpar.hf import tiny_model

    T, PG_T = datetime.timedelta(seconds=5), datetime.timedelta(seconds=40)
    flag, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    cpu = torch.device("cpu")

    def secs(g):
        return g._get_backend(cpu).options._timeout.total_seconds()

    init_process_group("gloo", timeout=PG_T)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = init_mesh(2, ulysses_degree=2, timeout=T)  # LOCAL_WORLD_SIZE=1: two one-process "nodes"
    inherit = init_mesh(1)  # no timeout: its subgroups take the default group's (not torch's 30 minutes)
    model = tiny_model("llama", 2, 2, num_layers=1, vocab_size=259, seed=0)
    apply_fsdp(model, cpu, 2, bf16=False, timeout=T)
    res = {"default": secs(dist.group.WORLD),
           "mesh": {n: secs(getattr(mesh, n + "_group")) for n in ("sp", "dp", "ring", "ulysses")},
           "inherit": {n: secs(getattr(inherit, n + "_group")) for n in ("dp", "ring", "ulysses")},
           "fsdp": secs(next(model.parameters()).device_mesh.get_group()),
           "warnings": [str(w.message) for w in caught]}
    if rank == 0:  # rank 1 never joins this all-reduce
        t0 = time.time()
        try:
            dist.all_reduce(torch.ones(1), group=mesh.sp_group)
            res["error"] = None
        except Exception as e:
            res["error"] = type(e).__name__ + ": " + str(e)[:300]
        res["elapsed"] = time.time() - t0
        open(flag, "w").write("done")
    else:
        deadline = time.time() + 60
        while not os.path.exists(flag) and time.time() < deadline:
            time.sleep(0.1)
    json.dump(res, open(out + str(rank) + ".json", "w"))
    sys.stdout.flush()
    os._exit(0)  # no teardown: the timed-out pair of sockets is not worth a clean shutdown
""")


def test_collective_timeout_reaches_every_group(tmp_path):
    """timeout=5 s on the mesh and FSDP2 (40 s on the default group): an all-reduce on the SP group that
    rank 1 never joins fails on rank 0 after ~5 s; every group has the timeout it was given."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="1")
    flag, out = tmp_path / "flag", str(tmp_path / "res")
    with contextlib.ExitStack() as stack:  # both killed on every way out
        procs = [stack.enter_context(spawned([sys.executable, "-c", HANG, str(flag), out],
                                             env=dict(env, RANK=str(r), LOCAL_RANK="0"), stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True)) for r in range(2)]
        logs = [communicate(p, timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    r0, r1 = (json.loads(Path(f"{out}{r}.json").read_text()) for r in range(2))
    print("rank 0:", {k: r0[k] for k in ("elapsed", "error")})
    assert r0["error"] is not None and 4.5 <= r0["elapsed"] < 20, r0
    for r in (r0, r1):
        assert r["default"] == 40 and r["fsdp"] == 5, r
        assert r["mesh"] == {"sp": 5, "dp": 5, "ring": 5, "ulysses": 5}, r
        assert r["inherit"] == {"dp": 40, "ring": 40, "ulysses": 40}, r
    # Explicit degrees that put a Ulysses group across nodes: one warning (rank 0) that names the fix.
    assert any("ulysses_degree=2 does not divide the 1 processes per node" in w for w in r0["warnings"]), r0
    assert not r1["warnings"]


# ----------------------------------------------------------------------------- two nodes on this machine
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sft_rows(tmp_path_factory.mktemp("multinode"))


def _yaml(data: Path, path: Path, **over) -> str:
    # 4 q / 4 kv heads: on one node of 4 the automatic degrees are ulysses 4; on nodes of 2, ulysses 2 x ring 2.
    cfg = {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 4, "num_layers": 1}},
           "dataset": {"path": str(data / "sft.jsonl"), "max_length": 64}, "micro_batch_size": 2, "max_steps": 4,
           "optimizer": {"lr": 1e-2}, "sequence_parallel": 4, "fsdp": True, "progress": False,
           "memory": {"measure": False}, "checkpoint": {"every": 2}, "timeout_minutes": 2}
    cfg.update(over)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1")


def _two_nodes(cmd_for_node, cwds: list[Path], timeout: float = 420) -> list[subprocess.CompletedProcess]:
    """Start one launcher per "node" (its own working folder), wait for both (killed after `timeout`)."""
    with contextlib.ExitStack() as stack:  # every launcher and its ranks killed on every way out
        procs = []
        for node, cwd in enumerate(cwds):
            cwd.mkdir(parents=True, exist_ok=True)
            procs.append(stack.enter_context(spawned(cmd_for_node(node), cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, text=True)))
            time.sleep(0.5)  # node 0 first, as a real job would usually start it (not required)
        deadline, outs = time.time() + timeout, []
        for p in procs:
            o, e = communicate(p, timeout=max(1.0, deadline - time.time()))
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return outs


def _seqpar_nodes(cfg: str, port: int, *extra: str):
    return lambda node: [sys.executable, "-m", "seqpar", "train", cfg, "--nproc-per-node", "2", "--nnodes", "2",
                         "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _ok(results):
    for r in results:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.slow
def test_two_nodes_fsdp_resume_matches_one_process(data, tmp_path):
    """2 nodes x 2 processes, FSDP2, SP=4 (ulysses 2 inside each node x ring 2): 2 steps, then a second launch
    resumes from checkpoint-2 to step 4. Losses and gradient norms equal a one-process SP=1 run's (1e-5)."""
    cfg = _yaml(data, tmp_path / "cfg.yaml")
    out = tmp_path / "shared_out"  # both nodes see it: a shared filesystem
    nodes = [tmp_path / "nodeA", tmp_path / "nodeB"]
    t0 = time.time()
    first = _two_nodes(_seqpar_nodes(cfg, free_port(), "--output-dir", str(out), "--max-steps", "2"), nodes)
    _ok(first)
    assert (out / "latest").read_text().strip() == "checkpoint-2" and [r["step"] for r in _rows(out)] == [1, 2]
    second = _two_nodes(_seqpar_nodes(cfg, free_port(), "--output-dir", str(out)), nodes)
    _ok(second)
    two_node_s = time.time() - t0
    said = "".join(r.stdout for r in second)
    assert "resuming from step 2" in said and said.count("launching node") == 2, said
    ref = tmp_path / "ref"
    r = run_command([sys.executable, "-m", "seqpar", "train", cfg, "--output-dir", str(ref), "--set",
                     "sequence_parallel=1", "--set", "fsdp=false"], env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _rows(out), _rows(ref)
    assert [x["step"] for x in got] == [1, 2, 3, 4] == [x["step"] for x in want]
    dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want))
    dgn = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, want))
    print(f"two nodes ({two_node_s:.0f}s for both launches) vs one process: max |dloss| {dloss:.2e}, "
          f"max |dgrad_norm| {dgn:.2e}")
    assert dloss <= 1e-5 and dgn <= 1e-5, (got, want)
    assert "ulysses=2" in (out / "mesh.txt").read_text() and "ring=2" in (out / "mesh.txt").read_text()
    ck = out / "checkpoint-4"
    assert sorted(p.name for p in ck.glob("trainer_state_rank*.pt")) == [f"trainer_state_rank{i}.pt" for i in range(4)]
    assert (out / "final" / "model.safetensors").is_file() and not (out / ".seqpar.lock").exists()
    assert all(not any(n.iterdir()) for n in nodes)  # nothing node-local lands in the working folders
    # The resume rules hold over nodes too (rank 0 checks the folder; every rank stops with its message).
    changed = _two_nodes(_seqpar_nodes(cfg, free_port(), "--output-dir", str(out), "--max-steps", "6", "--set",
                                       "optimizer.lr=0.02"), nodes)
    for r in changed:
        assert r.returncode == 2 and "cannot resume from" in r.stderr and "optimizer.lr: 0.01 -> 0.02" in r.stderr, \
            r.stdout[-2000:] + r.stderr[-3000:]
    assert [x["step"] for x in _rows(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_two_nodes_without_a_shared_output_dir(data, tmp_path):
    """output_dir relative to each node's working folder (no shared filesystem): checkpoints are refused on
    every rank (exit 2, one message); without them, plain torchrun runs and only rank 0's node writes."""
    cfg = _yaml(data, tmp_path / "cfg.yaml", max_steps=1)
    nodes = [tmp_path / "nodeA", tmp_path / "nodeB"]
    refused = _two_nodes(_seqpar_nodes(cfg, free_port(), "--output-dir", "run"), nodes)
    for r in refused:
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
        assert "is not on a filesystem every node shares" in r.stderr and "checkpoint.every: 0" in r.stderr, r.stderr
    for n in nodes:  # rank 0 released its lock; the other node never wrote anything
        assert not (n / "run" / ".seqpar.lock").exists()
    port = free_port()
    ran = _two_nodes(lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                   "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                                   "t", "-m", "seqpar", "train", cfg, "--output-dir", "run", "--set",
                                   "checkpoint.every=0"], nodes)
    _ok(ran)
    wrote = [n for n in nodes if (n / "run" / "metrics.jsonl").is_file()]
    assert len(wrote) == 1, [sorted(p.name for p in n.rglob("*")) for n in nodes]
    other = next(n for n in nodes if n not in wrote)
    assert not (other / "run").exists() or not any((other / "run").iterdir())
    assert (wrote[0] / "run" / "final" / "model.safetensors").is_file()
