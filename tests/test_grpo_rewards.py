"""GRPO rewards that cannot fail silently (docs/grpo.md, "Reward functions"): NaN / inf stop the step naming
the function and its counts, Nones and flat steps are counted and flagged, reward modules resolve from the
config folder and the working directory in every launch mode and are imported by `seqpar check`, and
`seqpar verify` refuses dp > 1 before its SP run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from procs import run_command

from seqpar.errors import SeqParError
from seqpar.train.grpo.rewards import reward_health, score

PROMPTS = [{"prompt": "alpha beta", "answer": "a"}, {"prompt": "gamma", "answer": "m"},
           {"prompt": "delta", "answer": "d"}, {"prompt": "eta", "answer": "t"}]
REWARDS_PY = '''
import math
def nan(prompts, completions, **kw):
    return [math.nan] * len(completions)
def inf_some(prompts, completions, **kw):
    return [math.inf if i % 2 else 1.0 for i in range(len(completions))]
def none_all(prompts, completions, **kw):
    return [None] * len(completions)
def one(prompts, completions, **kw):
    return [1.0] * len(completions)
'''


def _write_run(folder: Path, funcs: list[str], module: str = "myrewards", **over) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(REWARDS_PY)
    with open(folder / "prompts.jsonl", "w") as f:
        for r in PROMPTS:
            f.write(json.dumps(r) + "\n")
    cfg = {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 1}},
           "dataset": {"path": "prompts.jsonl", "max_length": 32}, "stage": "grpo",
           "grpo": {"reward_funcs": [f"{module}:{f}" if ":" not in f else f for f in funcs], "num_generations": 2,
                    "max_prompt_length": 16, "max_completion_length": 4},
           "micro_batch_size": 2, "grad_accum": 1, "max_steps": 1, "progress": False, "output_dir": "out",
           "export": {"final": False}, "memory": {"measure": False}, **over}
    (folder / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return folder / "cfg.yaml"


def _cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`seqpar ...` as a user runs it: the console script's interpreter, from `cwd`, the module NOT on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-c", "import sys; from seqpar.cli.main import main; sys.exit(main(sys.argv[1:]))", *args]
    return run_command(cmd, cwd=cwd, env=env, timeout=timeout)


# ----------------------------------------------------------------------------- fast guard (in-process)
def test_nonfinite_named_none_counted_flat_flagged(capsys):
    ids = [[1, 2], [3], [4, 5, 6], [7]]
    bad = {"nan": lambda p, c, **k: [float("nan"), 1.0, float("nan"), 2.0],
           "inf": lambda p, c, **k: [1.0, float("-inf"), 1.0, 1.0]}
    from seqpar.train.grpo import rewards as R

    try:
        R.BUILTIN_REWARDS.update(bad)
        with pytest.raises(SeqParError) as e:
            score(["seqpar:length", "seqpar:nan", "seqpar:inf"], None, ["p"] * 4, ["c"] * 4, ids, {})
    finally:
        for k in bad:
            R.BUILTIN_REWARDS.pop(k)
    msg = str(e.value)
    assert "'seqpar:nan' returned 2 NaN and 0 inf of 4" in msg and "'seqpar:inf' returned 0 NaN and 1 inf" in msg
    assert "seqpar:length" not in msg
    # None: no reward for that row, counted per function; a row with none at all counted as missing.
    per_func = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")], [0.5, 1.0], [0.5, 2.0]],
                            dtype=torch.float64)
    total = torch.nansum(per_func, dim=1)  # [1, 0, 1.5, 2.5]: group 0 varies, group 1 varies
    out = reward_health(per_func, total, ["f", "g"], 2)
    assert out == {"rewards_flat_groups": 0.0, "rewards_missing": 1, "rewards/f/none": 1, "rewards/g/none": 2}
    assert "no learning signal" not in capsys.readouterr().err
    flat = torch.tensor([1.0, 1.0, 0.3, 0.3], dtype=torch.float64)
    out = reward_health(flat[:, None], flat, ["f"], 2)
    assert out["rewards_flat_groups"] == 1.0
    assert "no learning signal this step: all 2 prompts" in capsys.readouterr().err
    half = torch.tensor([1.0, 1.0, 0.3, 0.4], dtype=torch.float64)
    assert reward_health(half[:, None], half, ["f"], 2)["rewards_flat_groups"] == 0.5
    assert "no learning signal" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- CLI (subprocesses)
@pytest.mark.slow
def test_nan_and_inf_rewards_stop_train_naming_the_function(tmp_path):
    """All-NaN (before: 3 steps with reward 0, grad_norm 0, exit 0) and inf stop step 1 with exit 2."""
    for func, needle in (("nan", "'myrewards:nan' returned 2 NaN and 0 inf of 2 values"),
                         ("inf_some", "'myrewards:inf_some' returned 0 NaN and 1 inf of 2 values")):
        cfg = _write_run(tmp_path / func, [func, "seqpar:length"])
        p = _cli(["train", str(cfg)], cwd=tmp_path)
        assert p.returncode == 2, p.stderr[-2000:]
        assert needle in p.stderr, p.stderr[-2000:]
        assert not (tmp_path / func / "out" / "metrics.jsonl").exists() or not (
            tmp_path / func / "out" / "metrics.jsonl").read_text().strip()


@pytest.mark.slow
def test_all_none_reward_counted_and_flagged(tmp_path):
    cfg = _write_run(tmp_path / "run", ["none_all"])
    p = _cli(["train", str(cfg)], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no learning signal this step" in p.stderr
    row = json.loads((tmp_path / "run" / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rewards/myrewards:none_all/none"] == 2 and row["rewards_missing"] == 2
    assert row["rewards_flat_groups"] == 1.0


@pytest.mark.slow
def test_reward_module_resolved_in_every_launch_mode(tmp_path):
    """The module next to the config (run from elsewhere) and one in the working directory import under
    `seqpar check`, one-process `seqpar train`, `--nproc-per-node 2` and `seqpar verify`'s SP and reference
    runs; a missing one is refused by `seqpar check` before anything starts."""
    cfg = _write_run(tmp_path / "cfgdir", ["one", "cwdrewards:one"])
    work = tmp_path / "work"
    work.mkdir()
    (work / "cwdrewards.py").write_text(REWARDS_PY)
    p = _cli(["check", str(cfg)], cwd=work)
    assert p.returncode == 0 and "[seqpar check] OK" in p.stdout, p.stderr[-2000:]
    p = _cli(["train", str(cfg), "--overwrite"], cwd=work)
    assert p.returncode == 0, p.stderr[-3000:]
    p = _cli(["train", str(cfg), "--nproc-per-node", "2", "--overwrite", "--set", "sequence_parallel=2"], cwd=work)
    assert p.returncode == 0, p.stderr[-3000:]
    p = _cli(["verify", str(cfg), "--steps", "1", "--nproc-per-node", "2", "--set", "sequence_parallel=2",
              "--set", "overwrite_output_dir=true"], cwd=work)
    assert p.returncode == 0 and "PASS" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    missing = _cli(["check", str(cfg)], cwd=tmp_path)  # cwdrewards.py is not in this working directory
    assert missing.returncode == 2
    assert "reward function 'cwdrewards:one' cannot be imported" in missing.stderr, missing.stderr[-2000:]


def test_check_imports_reward_modules_from_config_folder(tmp_path, monkeypatch, capsys):
    """Fast guard (in-process `seqpar check`): a module next to the config imports from another working
    directory; a missing one exits 2 naming the function and the fix."""
    from seqpar.cli.main import main

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cfg = _write_run(tmp_path / "cfgdir", ["one"], module="guardrewards")
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(cfg)]) == 0
    assert str(tmp_path / "cfgdir") in os.environ["PYTHONPATH"].split(os.pathsep)  # for the ranks it starts
    bad = _write_run(tmp_path / "bad", ["guardrewards_missing:one"])
    assert main(["check", str(bad)]) == 2
    assert "reward function 'guardrewards_missing:one' cannot be imported" in capsys.readouterr().err


BROKEN_MODULES = {  # module source -> what the one line says (every one exit 2, before anything starts)
    "def one(prompts, completions, **kw)\n    return [1.0]\n": "broken_syntax.py:1: SyntaxError (expected ':')",
    "import no_such_dependency_xyz\n": "importing broken_dep failed: No module named 'no_such_dependency_xyz'",
    "raise RuntimeError('needs an API key')\n": "importing broken_raise raised RuntimeError: needs an API key",
    "x = 1\n": "broken_name (",
}


def test_reward_module_that_cannot_load_is_one_line(tmp_path, monkeypatch, capsys):
    """A syntax error in a reward module (the issue's case: a 36-line traceback, exit 1), a missing dependency,
    an exception at its top level and a missing function: one `seqpar: error:` line each, exit 2."""
    from seqpar.cli.main import main

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    for (source, needle), name in zip(BROKEN_MODULES.items(), ("syntax", "dep", "raise", "name")):
        cfg = _write_run(tmp_path / name, ["one"], module=f"broken_{name}")
        (tmp_path / name / f"broken_{name}.py").write_text(source)
        capsys.readouterr()
        assert main(["check", str(cfg)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("seqpar: error: reward function "), err
        assert needle in err, err
    assert "has no 'one'" in err


def test_rewards_must_be_numbers():
    """docs/grpo.md: a non-number stops the run naming the function and the value (strings such as "1.0" used to
    be converted to floats); numbers of any kind (int, bool, numpy scalar, one-element tensor) are taken."""
    import numpy as np

    from seqpar.train.grpo import rewards as R

    funcs = {"strings": lambda p, c, **k: ["1.0", "0.5"], "mixed": lambda p, c, **k: [1.0, [0.5]],
             "numbers": lambda p, c, **k: [np.float32(0.25), torch.tensor([2.0])],
             "ints": lambda p, c, **k: [1, True]}
    try:
        R.BUILTIN_REWARDS.update(funcs)
        for name, needle in (("strings", "returned '1.0' (str) for completion 0"),
                             ("mixed", "returned [0.5] (list) for completion 1")):
            with pytest.raises(SeqParError) as e:
                score([f"seqpar:{name}"], None, ["p"] * 2, ["a", "b"], [[1], [2]], {})
            assert f"reward function 'seqpar:{name}' {needle}: return numbers" in str(e.value), str(e.value)
        per, total = score(["seqpar:numbers", "seqpar:ints"], None, ["p"] * 2, ["a", "b"], [[1], [2]], {})
        assert per.tolist() == [[0.25, 1.0], [2.0, 1.0]] and total.tolist() == [1.25, 3.0]
    finally:
        for k in funcs:
            R.BUILTIN_REWARDS.pop(k)


def test_verify_refuses_grpo_dp2_before_the_sp_run(tmp_path):
    from seqpar.train.config import load_config
    from seqpar.train.verify import verify

    cfg = load_config(_write_run(tmp_path / "run", ["seqpar:length"], sequence_parallel=2))
    with pytest.raises(SeqParError, match="needs dp = 1"):
        verify(cfg, steps=1, nproc=4, out_dir=tmp_path / "verify")
    assert not (tmp_path / "verify" / "sp").exists() and not (tmp_path / "verify" / "sp_config.yaml").exists()


def test_grpo_prompt_rows_with_images_refused(tmp_path):
    """GRPO generates from text prompts: a row with images is refused, not trained as text with its images lost."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prompts import load_prompts
    from seqpar.train.model.tokenizers import ByteTokenizer

    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "answer": "x"}\n{"prompt": "<image> b", "images": ["i.png"]}\n')
    cfg = config_from_dict({"model": "tiny:llama", "dataset": {"path": str(tmp_path / "p.jsonl"), "max_length": 64},
                            "stage": "grpo", "micro_batch_size": 2,
                            "grpo": {"reward_funcs": ["seqpar:length"], "num_generations": 2, "max_prompt_length": 32,
                                     "max_completion_length": 16}})
    with pytest.raises(SeqParError, match="row 2 carries images/videos"):
        load_prompts(cfg, ByteTokenizer())
