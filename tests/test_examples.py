"""The README's custom-model example runs on 4 ranks and matches the single-process layer (fp32, 2e-5)."""

import importlib.util
import pathlib

from seqpar.spawn import run_distributed

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_attention.py"


def _run_example():
    spec = importlib.util.spec_from_file_location("custom_attention", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main()


def test_custom_attention_example():
    errs = run_distributed(_run_example, 4, timeout=180)
    assert max(errs) < 2e-5, errs
