"""The suite's own rules (tests/conftest.py, tests/procs.py), each shown to bite.

- A skip whose reason does not name CUDA fails the run (also an xfail, and a module-level importorskip at
  collection); a "needs a CUDA GPU" skip stays a skip.
- No test module calls pytest.importorskip, or starts a process other than through tests/procs.py (which gives every
  process a timeout and kills it, with all it started, on every path).
- Each test's deadline ($SEQPAR_SPAWN_DEADLINE) follows its timeout, and cuts spawn and subprocess timeouts to it.
- A timed-out command is killed with its whole tree, also a grandchild in a session of its own.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from procs import TOKEN_ENV, run_command

from seqpar.spawn import DEADLINE_ENV, capped_timeout

TESTS = Path(__file__).parent

SAMPLE = '''
import pytest

def test_passes():
    pass

def test_plain_skip():
    pytest.skip("the network is down")

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_cuda_skip():
    pass

@pytest.mark.xfail(reason="known bug")
def test_xfail():
    assert False
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one_process", "xdist"])
def test_a_skip_that_does_not_need_cuda_fails_the_run(tmp_path, workers):
    """Also on `make test`'s two pytest-xdist workers, whose reports the controller receives already failed."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_missing_dep.py").write_text('import pytest\npytest.importorskip("no_such_module_anywhere")\n')
    # (a collection error alone stops a run: --continue-on-collection-errors shows the items' outcomes too)
    r = run_command([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts=",
                     "--continue-on-collection-errors", *workers, str(tmp_path)], cwd=tmp_path, timeout=240,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "2 failed" in last and "1 passed" in last and "1 skipped" in last and "1 error" in last, out[-3000:]
    assert "FAILED test_sample.py::test_plain_skip" in out and "FAILED test_sample.py::test_xfail" in out, out[-3000:]
    assert "SKIPPED [1] test_sample.py" in out and "needs a CUDA GPU" in out, out[-3000:]
    assert "ERROR test_missing_dep.py" in out and "no_such_module_anywhere" in out, out[-3000:]


def _calls(tree: ast.AST) -> list[str]:
    """Dotted names of every call in `tree` (subprocess.Popen, pytest.importorskip, os.system, ...)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f, parts = node.func, []
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                out.append(".".join([f.id, *reversed(parts)]))
    return out


def test_no_importorskip_and_no_process_outside_procs():
    starts = {"subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
              "subprocess.check_output", "os.system", "os.popen", "os.fork", "os.spawnv", "os.execv"}
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        calls = _calls(ast.parse(path.read_text()))
        bad += [f"{path.name}: {c}" for c in calls if c == "pytest.importorskip"]
        if path.name != "procs.py":
            bad += [f"{path.name}: {c} (use procs.run_command / procs.spawned)" for c in calls if c in starts]
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(123)
def test_deadline_follows_the_tests_timeout():
    left = float(os.environ[DEADLINE_ENV]) - time.time()
    assert 123 - 12.3 - 5 < left <= 123 - 12.3, left  # the limit less a tenth (short limits) or 30 s
    cut, why = capped_timeout(900)
    assert cut <= left and DEADLINE_ENV in why
    assert capped_timeout(5) == (5, "")


def test_default_deadline_is_the_suite_limit(pytestconfig):
    left = float(os.environ[DEADLINE_ENV]) - time.time()
    limit = float(pytestconfig.getini("timeout"))
    assert limit == 600 and limit - 30 - 5 < left <= limit - 30, left



def _env(name: str) -> str | None:
    return os.environ.get(name)


def _cwd() -> str:
    return os.getcwd()


def _say(text: str) -> None:
    print(f"stdout {text}", flush=True)
    print(f"stderr {text}", file=sys.stderr, flush=True)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_write_where_the_caller_writes(monkeypatch, capfd, method):
    """A rank's stdout / stderr are the caller's at the call (pytest's capture here), under either start method:
    a forkserver child would otherwise write to the server's, i.e. wherever they went when it started."""
    from seqpar.spawn import START_METHOD_ENV, run_distributed

    monkeypatch.setenv(START_METHOD_ENV, method)
    with capfd.disabled():  # a forkserver not up yet starts here, writing elsewhere than this test's capture
        run_distributed(_env, 1, "SEQPAR_PROBE", timeout=60)
    run_distributed(_say, 2, method, timeout=60)
    out, err = capfd.readouterr()
    assert out.count(f"stdout {method}") == 2 and err.count(f"stderr {method}") == 2, (out, err)


def test_forkserver_ranks_take_the_callers_environment(monkeypatch, tmp_path):
    """The suite forks its worlds from a forkserver (conftest): a variable set after the server started (it starts
    with the first world of the session) must still reach the ranks, as it would a spawned process; so must a
    working directory changed since."""
    from seqpar.spawn import START_METHOD_ENV, run_distributed

    assert os.environ[START_METHOD_ENV] == "forkserver"
    run_distributed(_env, 1, "SEQPAR_PROBE", timeout=60)  # the server is up from here on
    monkeypatch.setenv("SEQPAR_PROBE", "set-after-the-server")
    assert run_distributed(_env, 2, "SEQPAR_PROBE", timeout=60) == ["set-after-the-server"] * 2
    monkeypatch.delenv("SEQPAR_PROBE")
    assert run_distributed(_env, 1, "SEQPAR_PROBE", timeout=60) == [None]
    monkeypatch.chdir(tmp_path)  # and the working directory
    assert run_distributed(_cwd, 1, timeout=60) == [str(tmp_path)]
    from seqpar import SeqParError

    for method in ("fork", "threads"):  # one line for the CLI, naming what threads are (issue 51)
        monkeypatch.setenv(START_METHOD_ENV, method)
        with pytest.raises(SeqParError, match="'spawn' .*or 'forkserver'.*run_threaded"):
            run_distributed(_env, 1, "X", timeout=60)

GRANDCHILD = '''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_timed_out_command_is_killed_with_its_whole_tree(tmp_path):
    """The grandchild sits in a session of its own (as torchrun's ranks do): the token in its environment finds it."""
    pid_file = tmp_path / "pid"
    t0 = time.time()
    with pytest.raises(AssertionError, match="timed out after 8s"):
        run_command([sys.executable, "-c", GRANDCHILD, str(pid_file)], timeout=8)
    assert time.time() - t0 < 45
    pid = int(pid_file.read_text())
    assert TOKEN_ENV.encode() not in Path("/proc/self/environ").read_bytes()
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"grandchild {pid} outlived its test"
