"""Which nodes a run spans: `seqpar train` flags or SLURM's variables -> torchrun's launch arguments.

    seqpar train cfg.yaml --nproc-per-node 8 --nnodes 2 --node-rank R --rdzv-endpoint node0:29500   # on each node
    srun --ntasks-per-node=1 seqpar train cfg.yaml --nproc-per-node 8                            # SLURM: the same
    seqpar train cfg.yaml --nproc-per-node 8 --nnodes 1:2 ... --max-restarts 3                   # elastic
    seqpar train cfg.yaml ... --rdzv-conf last_call_timeout=10,keep_alive_interval=2            # rendezvous timing

Elastic (`--nnodes MIN:MAX`, torchrun's form): the run starts on the nodes that arrive (up to MAX) and, when
a node is lost, the surviving agents restart their ranks (a --max-restarts attempt) on the MIN..MAX nodes
left; the ranks then resume from the last complete checkpoint at the new world size (resume.py: any layout;
global_batch_size keeps the global batch). Every world size MIN..MAX could become is checked before launch.
Node 0 hosts the rendezvous store: it must be a node that stays.

Every node runs one launcher; the launchers meet at a c10d rendezvous (`--rdzv-endpoint`, a HOST:PORT on
node 0 that every node can reach; node 0 hosts its store). torchrun numbers the ranks node by node, so each
node holds LOCAL_WORLD_SIZE = nproc_per_node consecutive ranks; where global rank 0 lands is the
rendezvous's choice, and the output_dir logic (process.py, `take_lock`) does not depend on it.

SLURM (SLURM_JOB_ID set, and an `srun` step over more than one node, SLURM_STEP_NUM_NODES; or --nnodes > 1
inside an allocation), for each value the command line leaves out:
  nnodes          SLURM_STEP_NUM_NODES (the batch script itself, on the first node only, is one node)
  node_rank       SLURM_NODEID
  rdzv_endpoint   MASTER_ADDR[:MASTER_PORT] when set, else the first host of SLURM_STEP_NODELIST /
                  SLURM_JOB_NODELIST, port MASTER_PORT or 29500
  rdzv_id         SLURM_JOB_ID[.SLURM_STEP_ID]
  nproc_per_node  SLURM_GPUS_ON_NODE
A step with more than one task per node is refused: each task would start its own nproc_per_node ranks.

--rdzv-conf KEY=VALUE,... tunes torch's c10d rendezvous (RDZV_KEYS, seconds or a count): how long a restart waits
for more nodes once MIN are there (last_call_timeout, 30), how soon a silent node counts as lost
(keep_alive_interval x keep_alive_max_attempt, 5 x 3), how long nodes wait to meet (join_timeout, 600). torch
ignores a key it does not know, so one here is refused; is_host is seqpar's (node 0 hosts the store).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import SeqParError

__all__ = ["NodeLaunch", "resolve_nodes", "first_slurm_host", "parse_rdzv_conf", "DEFAULT_PORT", "RDZV_KEYS"]

DEFAULT_PORT = 29500  # torchrun's default master port
# The c10d rendezvous settings torch reads (torch.distributed.elastic.rendezvous), each a positive integer.
RDZV_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
             "keep_alive_max_attempt", "read_timeout", "timeout")


@dataclass(frozen=True)
class NodeLaunch:
    """One node's part of a launch: nproc_per_node ranks on node `node_rank` of `nnodes` (elastic: of
    min_nodes..nnodes)."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT, for nnodes > 1
    rdzv_id: str | None = None  # the same on every node, for nnodes > 1
    source: str = "command line"  # or "SLURM": where the values came from (the launch line says)
    min_nodes: int | None = None  # elastic (--nnodes MIN:MAX): the fewest nodes the run goes on with
    rdzv_conf: tuple[tuple[str, int], ...] = ()  # --rdzv-conf, checked by parse_rdzv_conf

    @property
    def world(self) -> int:
        """The largest world size (every node)."""
        return self.nproc_per_node * self.nnodes

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def worlds(self) -> list[int]:
        """Every world size the run can have (one, unless elastic)."""
        low = self.min_nodes if self.elastic else self.nnodes
        return [self.nproc_per_node * k for k in range(low, self.nnodes + 1)]

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def torchrun_args(self, max_restarts: int, run_id: str) -> list[str]:
        """torch.distributed.run arguments (before the module) for this node's agent."""
        args = [f"--nproc-per-node={self.nproc_per_node}", f"--max-restarts={max_restarts}", "--rdzv-backend=c10d"]
        if not self.multi_node:  # as `torchrun --standalone`: a private store on a free local port
            return args + ["--rdzv-endpoint=localhost:0", f"--rdzv-id={run_id}", "-m", "seqpar"]
        # is_host: node 0 hosts the rendezvous store at the endpoint; the others connect to it (torch's own
        # guess from the host name fails on one machine, and for an endpoint on another interface).
        nnodes = f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)
        conf = ",".join([f"is_host={'true' if self.node_rank == 0 else 'false'}",
                         *(f"{k}={v}" for k, v in self.rdzv_conf)])
        return args + [f"--nnodes={nnodes}", f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}",
                       f"--rdzv-conf={conf}", "-m", "seqpar"]

    def describe(self) -> str:
        if self.elastic:
            return (f"node {self.node_rank} of {self.min_nodes}..{self.nnodes} (elastic, {self.source}), "
                    f"{self.nproc_per_node} processes per node, world {' / '.join(map(str, self.worlds))}; rendezvous "
                    f"{self.rdzv_endpoint} (id {self.rdzv_id})")
        return (f"node {self.node_rank} of {self.nnodes} ({self.source}), {self.nproc_per_node} processes per node, "
                f"world {self.world}; rendezvous {self.rdzv_endpoint} (id {self.rdzv_id})")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist ("gpu[003-004,9],login1" -> "gpu003"; "a[1-2]-ib[3-4]" -> "a1-ib3")."""
    nodelist = nodelist.strip()
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first host expression
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    first = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], nodelist[:end])
    if not first or "[" in first or "]" in first:
        raise SeqParError(f"cannot read the first host of SLURM's node list {nodelist!r}: pass --rdzv-endpoint "
                          f"HOST:PORT")
    return first


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name, "").strip()
    m = re.match(r"^(\d+)", v)  # SLURM_GPUS_ON_NODE / SLURM_NTASKS_PER_NODE may read "4" or "4(x2)"
    return int(m.group(1)) if m else None




def _endpoint(env: Mapping[str, str], slurm: bool) -> str | None:
    port = env.get("MASTER_PORT") or str(DEFAULT_PORT)
    if env.get("MASTER_ADDR"):
        return f"{env['MASTER_ADDR']}:{port}"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if slurm and nodelist:
        return f"{first_slurm_host(nodelist)}:{port}"
    return None


def _check_endpoint(ep: str) -> None:
    host, _, port = ep.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SeqParError(f"--rdzv-endpoint {ep!r}: write it as HOST:PORT (a free port on node 0, the same on every "
                          f"node, e.g. node0:{DEFAULT_PORT})")


def _refuse_tasks_per_node(env: Mapping[str, str], nodes: int) -> None:
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if tasks is not None and tasks > nodes:
        raise SeqParError(f"this SLURM step runs {tasks} tasks on {nodes} nodes: `seqpar train` starts the "
                          f"processes of its node itself, so run ONE task per node (srun --ntasks-per-node=1, "
                          f"#SBATCH --ntasks-per-node=1) and give --nproc-per-node")


def _node_range(nnodes: int | str | None) -> tuple[int | None, int | None]:
    """--nnodes N or MIN:MAX -> (MIN or None, N or MAX)."""
    if nnodes is None or isinstance(nnodes, int):
        return None, nnodes
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(nnodes))
    if m is None or (m.group(2) is not None and not 1 <= int(m.group(1)) <= int(m.group(2))):
        raise SeqParError(f"--nnodes {nnodes!r}: give the number of nodes (2), or MIN:MAX (1:2) for an elastic run "
                          f"that goes on with at least MIN nodes")
    if m.group(2) is None:
        return None, int(m.group(1))
    return int(m.group(1)), int(m.group(2))


def parse_rdzv_conf(text: str | None) -> tuple[tuple[str, int], ...]:
    """--rdzv-conf "KEY=VALUE,..." -> ((key, value), ...); SeqParError naming the fix for anything torch would
    ignore or refuse."""
    if not text:
        return ()
    out = []
    for item in text.split(","):
        key, eq, value = (x.strip() for x in item.partition("="))
        if key == "is_host":
            raise SeqParError("--rdzv-conf is_host: seqpar sets it (node 0 hosts the rendezvous store): drop it")
        if key not in RDZV_KEYS:
            raise SeqParError(f"--rdzv-conf {item!r}: write KEY=VALUE pairs separated by commas, KEY one of "
                              f"{', '.join(RDZV_KEYS)}")
        if not (eq and value.isdigit() and int(value) > 0):
            raise SeqParError(f"--rdzv-conf {key}={value}: give a positive whole number (seconds, or a count)")
        out.append((key, int(value)))
    return tuple(out)


def resolve_nodes(nproc_per_node: int | None = None, nnodes: int | str | None = None, node_rank: int | None = None,
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                  env: Mapping[str, str] | None = None, rdzv_conf: str | None = None) -> NodeLaunch:
    """This node's launch from the command line, filled in from SLURM's variables in `env` (module docstring).
    nnodes: N, or "MIN:MAX" (elastic). SeqParError for a launch that cannot work, naming the flag to fix."""
    env = {} if env is None else env
    conf = parse_rdzv_conf(rdzv_conf)
    min_nodes, nnodes = _node_range(nnodes)
    # Only an srun step says how many nodes run this command: SLURM_NNODES is the allocation's, also seen by
    # the batch script, which runs on the first node alone.
    step_nodes = _int(env, "SLURM_STEP_NUM_NODES")
    slurm = bool(env.get("SLURM_JOB_ID")) and (nnodes if nnodes is not None else step_nodes or 1) > 1
    if slurm:
        nnodes = nnodes if nnodes is not None else step_nodes
        _refuse_tasks_per_node(env, nnodes)
        node_rank = node_rank if node_rank is not None else _int(env, "SLURM_NODEID")
        nproc_per_node = nproc_per_node if nproc_per_node is not None else _int(env, "SLURM_GPUS_ON_NODE")
        step = f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else ""
        rdzv_id = rdzv_id or f"slurm-{env['SLURM_JOB_ID']}{step}"
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise SeqParError(f"--nnodes {nnodes}: use the number of nodes (1 or more)")
    if nproc_per_node is None or nproc_per_node < 1:
        if nnodes > 1 or nproc_per_node is not None:
            raise SeqParError(f"--nproc-per-node {nproc_per_node}: give the number of processes per node (GPUs per "
                              f"node; on CPU, any number >= 1)")
        nproc_per_node = 1
    if nnodes == 1:
        extra = [f for f, v in (("--node-rank", node_rank), ("--rdzv-endpoint", rdzv_endpoint),
                                ("--rdzv-id", rdzv_id), ("--rdzv-conf", rdzv_conf or None)) if v is not None]
        if extra:
            raise SeqParError(f"{', '.join(extra)} only apply to a launch over several nodes: add --nnodes N, or "
                              f"drop them for one node")
        return NodeLaunch(nproc_per_node)
    node_rank = 0 if node_rank is None else node_rank
    if not 0 <= node_rank < nnodes:
        raise SeqParError(f"--node-rank {node_rank} is not a node of --nnodes {nnodes}: use 0 .. {nnodes - 1} "
                          f"(0 on the node whose address --rdzv-endpoint names)")
    ep = rdzv_endpoint or _endpoint(env, slurm)
    if ep is None:
        raise SeqParError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address and a free port, "
                          f"the same on every node), or MASTER_ADDR and MASTER_PORT in the environment")
    _check_endpoint(ep)
    # Every node must name the same rendezvous: without SLURM's job id, the endpoint itself is shared by all.
    rid = rdzv_id or f"seqpar-{ep}"
    return NodeLaunch(nproc_per_node, nnodes, node_rank, ep, rid, "SLURM" if slurm else "command line", min_nodes,
                      conf)
