"""Suite-wide rules (tests/test_suite_rules.py checks both).

1. A skip is a failure unless its reason names CUDA. `make test` installs every dependency (transformers, TRL,
   PEFT, DeepSpeed, the bundled SmolLM2), so a skip of anything else means a broken install, a renamed module or a
   missing file, and CI must go red, not quietly run less. The only skips left are the GPU tests' "needs a CUDA
   GPU" (and the CPU-only checks' "a CUDA GPU is present" on a GPU machine). xfail counts as a skip here.
2. Every test has a deadline: its pytest-timeout limit less a margin. It is exported as $SEQPAR_SPAWN_DEADLINE for
   the whole test (setup included: module fixtures that spawn worlds count), and seqpar.spawn.run_distributed and
   tests/procs.py cut every timeout to it, so a hang is reported (and its processes killed) by the test itself,
   with the ranks' state, before pytest's own limit would kill the test without either.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time

import pytest

# The suite never downloads (models are tiny configs or bundled files): a hub id that is not cached must fail at
# once, as it does offline for users with HF_HUB_OFFLINE=1, not after huggingface_hub's ~20 s of retries.
# Set before anything imports huggingface_hub, which reads it once; spawned ranks inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Spawned worlds fork from one server that imported torch and transformers once (seqpar.spawn): the same ranks,
# without ~2 s of imports per rank (the fast suite runs hundreds of worlds).
os.environ.setdefault("SEQPAR_START_METHOD", "forkserver")

from seqpar.spawn import DEADLINE_ENV  # noqa: E402

# tests/vllm_env needs vLLM, which lives in its own environment: `make test` runs that folder there (make vllm-env,
# make test-vllm) after the main suite; the main environment, which has no vLLM, does not collect it.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm_env"]

ALLOWED_SKIP = re.compile(r"\bCUDA\b")
MARGIN_S = 30.0  # for the test to kill its processes and report; at most a tenth of a short limit


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return getattr(report, "wasxfail", None) or str(lr)


def _fail_unless_cuda(report, what: str) -> None:
    reason = _reason(report)
    if report.skipped and not ALLOWED_SKIP.search(reason):
        report.outcome = "failed"
        report.longrepr = (f"{what} was skipped ({reason}); the only skips allowed are for a missing CUDA GPU: "
                           "`make test` installs every dependency, so this skip hides a broken install or test "
                           "(tests/conftest.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unless_cuda(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_unless_cuda(outcome.get_result(), collector.nodeid or "collection")  # importorskip at module level


def item_timeout(item) -> float:
    """The test's pytest-timeout limit in seconds (its timeout marker, else --timeout / the ini's), 0 if none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = getattr(item.config, "_env_timeout", None) or item.config.getini("timeout")
    return float(value or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = item_timeout(item)
    old = os.environ.get(DEADLINE_ENV)
    if limit > 0:
        os.environ[DEADLINE_ENV] = str(time.time() + limit - min(MARGIN_S, limit / 10))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(DEADLINE_ENV, None)
        else:
            os.environ[DEADLINE_ENV] = old
