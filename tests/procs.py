"""Subprocesses for the tests: every one with a timeout, and killed with all it started on every way out.

`run_command` (subprocess.run for tests) and `spawned` (a Popen as a context manager) start each command in a
new session with a fresh token in its environment. On leaving -- finished, timed out, failed or interrupted
(pytest's timeout) -- its process group and every process carrying the token are killed: torchrun starts its
ranks in sessions of their own, and a launcher killed first leaves its ranks to init, so the group alone would
miss them. A timeout is cut to the test's own deadline ($SEQPAR_SPAWN_DEADLINE, set per test by conftest.py), so
the test's message, not pytest's limit, reports a hang. tests/test_suite_rules.py checks that no test starts a
process another way. Also here: training scripts under torchrun (tests that exercise the HF Trainer drop-ins as
users do) and shared fixtures' rows.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

from seqpar.spawn import capped_timeout

# torch's gloo teardown can abort a FINISHED process during interpreter finalisation on a loaded
# machine (std::terminate, SIGABRT, after the script's last line). Stock transformers.Trainer + DDP
# does the same under torchrun here, without seqpar, so it is not what these tests check.
_TEARDOWN_ABORT = "terminate called without an active exception"


# 16 ragged SFT rows (token ids 3..63, first 5 positions unsupervised) as `ds`, and `pad_collate`, the stock
# Trainer's padding collator for them: shared by the scripts that compare the drop-ins with the stock Trainer
# under DeepSpeed / FSDP / ParallelismConfig. Pasted into those scripts (they run from temporary folders).
SFT_ROWS_SCRIPT = r'''g = torch.Generator().manual_seed(0)
rows = []
for i in range(16):
    n = int(torch.randint(20, 60, (1,), generator=g))
    ids = torch.randint(3, 64, (n,), generator=g).tolist()
    rows.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
ds = datasets.Dataset.from_list(rows)

def pad_collate(batch):
    m = max(len(r["input_ids"]) for r in batch)
    ids = torch.tensor([r["input_ids"] + [0] * (m - len(r["input_ids"])) for r in batch])
    lab = torch.tensor([r["labels"] + [-100] * (m - len(r["labels"])) for r in batch])
    att = torch.tensor([[1] * len(r["input_ids"]) + [0] * (m - len(r["input_ids"])) for r in batch])
    return {"input_ids": ids, "labels": lab, "attention_mask": att}
'''

# full_params(m): every parameter of `m` as a full tensor, by name, on every rank -- a collective under ZeRO-3
# (gathered) and FSDP2 (DTensor.full_tensor), so every rank calls it; and check_params(result_dir, ref_dir): the
# final parameters of an SP run and its reference within 1e-5, after they moved. Pasted into / used by the stack
# scripts (DeepSpeed, FSDP2, ParallelismConfig) that compare the drop-ins with the stock trainers.
FULL_PARAMS_SCRIPT = r'''
def full_params(m):
    if any(hasattr(p, "ds_id") for p in m.parameters()):  # ZeRO-3: partitioned; gathered here
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(m.parameters())):
            return {k: v.detach().clone() for k, v in m.named_parameters()}
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in m.named_parameters()}
'''


def check_params(sp_dir: Path, ref_dir: Path, tol: float = 1e-5) -> float:
    """sp_dir/params.pt vs ref_dir/params.pt (the final parameters: full_params of rank 0) within `tol`; where the
    reference saved its initial ones (init_params.pt), they moved by more than 1e-3 (the check is not vacuous)."""
    import torch

    got, want = torch.load(Path(sp_dir) / "params.pt"), torch.load(Path(ref_dir) / "params.pt")
    assert got.keys() == want.keys() and want, (sorted(got)[:5], sorted(want)[:5])
    dparam = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert dparam <= tol, dparam
    if (Path(ref_dir) / "init_params.pt").exists():
        init = torch.load(Path(ref_dir) / "init_params.pt")
        moved = max(float((want[k] - init[k]).abs().max()) for k in want)
        assert moved > 1e-3, moved
    return dparam


# 16 words for the JSONL fixtures' random phrases (the same draws in every test that uses them)
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def phrase(rng: random.Random, lo: int, hi: int) -> str:
    """lo..hi words of WORDS, drawn with rng."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def write_sft_rows(folder: Path) -> Path:
    """8 short Alpaca rows (instruction / response) as folder/sft.jsonl; returns `folder`."""
    import json

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    with open(folder / "sft.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"instruction": " ".join(words[i:i + 3]), "response": " ".join(words[:i + 2])}) + "\n")
    return folder

# Each `spawned` command gets a fresh token in this variable; every process that inherits it (whatever session
# or parent it ends up with: torchrun starts its ranks in new sessions, a killed launcher's ranks go to init) is
# found by it in /proc and killed with the command.
TOKEN_ENV = "SEQPAR_TEST_PROCESS"


def _holders(token: str) -> list[int]:
    """Processes whose environment carries TOKEN_ENV=token (Linux /proc; elsewhere none)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    pids = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except (OSError, ValueError):
            continue
    return pids


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its process group and every process carrying its token (see `spawned`); reap `proc`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    token = getattr(proc, "seqpar_token", None)
    for _ in range(3):  # a dying launcher may still start a rank: look again
        pids = [pid for pid in _holders(token) if pid != os.getpid()] if token else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


@contextlib.contextmanager
def spawned(cmd: list[str], env: dict | None = None, **popen_kw) -> Iterator[subprocess.Popen]:
    """subprocess.Popen(cmd, env=env, **popen_kw) in a new session, marked with a token in its environment; it and
    everything it started are killed when the block ends, however it ends (also after a clean exit: nothing it
    left behind outlives the test)."""
    token = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, start_new_session=True, env={**(os.environ if env is None else env),
                                                              TOKEN_ENV: token}, **popen_kw)
    proc.seqpar_token = token
    try:
        yield proc
    finally:
        kill_group(proc)


def communicate(proc: subprocess.Popen, timeout: float, stdin: str | None = None) -> tuple[str, str]:
    """proc.communicate within `timeout` (cut to the test's deadline); past it, the group is killed and the test
    fails with the command and the end of its output."""
    timeout, cut = capped_timeout(timeout)
    try:
        return proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s{cut}: {proc.args}\n{(out or '')[-2000:]}"
                             f"\n{(err or '')[-3000:]}") from None


def run_command(cmd: list[str], *, timeout: float, env: dict | None = None, cwd: Path | str | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) for tests: a timeout always, and the process with all
    it started killed on every path (see `spawned`)."""
    with spawned(cmd, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL) as proc:
        out, err = communicate(proc, timeout, stdin)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_script(cmd: list[str], cwd: Path, result: Path | None = None, timeout: float = 400) -> None:
    """Run `cmd` (1 thread per process); fail with its output unless it exited 0.

    `result`: the file the script writes as its very last step. If it exists and the only failure is the
    teardown abort above, the run counts as finished (the test still checks everything in `result`).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = run_command(cmd, env=env, timeout=timeout, cwd=cwd)
    if r.returncode != 0 and result is not None and result.exists() and _TEARDOWN_ABORT in r.stderr:
        print(f"note: {cmd[-3:]} finished (wrote {result.name}) and then aborted in interpreter teardown (upstream)")
        return
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]


def plain_and_sp(script_text: str, tmp_path: Path, nproc: int = 2, timeout: float = 500) -> tuple[dict, dict]:
    """Run `script_text` as `script plain OUT` in one process and `script sp OUT` under torchrun on `nproc` ranks;
    each writes OUT/result.json as its last step. Returns (plain, sp) results."""
    import json
    import sys

    script = tmp_path / "s.py"
    script.write_text(script_text)
    for cmd in ([sys.executable, str(script), "plain", str(tmp_path / "plain")],
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                 str(script), "sp", str(tmp_path / "sp")]):
        run_script(cmd, tmp_path, result=Path(cmd[-1]) / "result.json", timeout=timeout)
    return tuple(json.loads((tmp_path / m / "result.json").read_text()) for m in ("plain", "sp"))


def run_verify(cfg: dict, tmp_path: Path, steps: int, nproc: int = 2, timeout: float = 600) -> dict:
    """Write `cfg` as tmp_path/cfg.yaml, run `seqpar verify` on it (nproc SP processes vs the in-process
    SP=1 reference) into tmp_path/verify; return its verify.json (fail with the output unless it exited 0)."""
    import json
    import sys

    import yaml

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "verify"
    r = run_command([sys.executable, "-m", "seqpar", "verify", str(tmp_path / "cfg.yaml"), "--steps", str(steps),
             "--nproc-per-node", str(nproc), "--output-dir", str(out)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                    timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "verify.json").read_text())


def check_same_training(tmp_path: Path, plain: dict, sp: dict, steps: int, init: dict, tol: float = 1e-5) -> float:
    """The SP run of `plain_and_sp` trained as the plain one did (SGD, so a gradient-scale error shows): every step's
    loss within `tol`, gradient norm before clipping within `tol` relative, and the final parameters (each side's
    params.pt) within `tol`; the parameters moved from `init` (the comparison is not vacuous). Returns max |dparam|."""
    import torch

    assert len(sp["losses"]) == len(plain["losses"]) == steps == len(sp["grad_norms"]) == len(plain["grad_norms"])
    assert max(abs(a - b) for a, b in zip(sp["losses"], plain["losses"])) <= tol, (sp, plain)
    assert max(abs(a - b) / b for a, b in zip(sp["grad_norms"], plain["grad_norms"])) <= tol, (sp, plain)
    a, b = (torch.load(tmp_path / m / "params.pt") for m in ("plain", "sp"))
    assert a.keys() == b.keys() == init.keys()
    dparam = max(float((a[k] - b[k]).abs().max()) for k in a)
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    assert dparam <= tol and moved > 1e-3, (dparam, moved)
    return dparam
