"""The conversion cache (seqpar.hf.cache) and the cached SmolLM2 load.

Fast: three processes ask for the same cache entry at once: exactly one converts, all get the same
complete directory. Slow (converts the GGUF once, ~1 min on 2 cores): the second load comes from the
cache without touching the GGUF, and both the weights (bitwise) and the tokenizer equal a direct GGUF load.
"""

from __future__ import annotations

import os
import time

import pytest

from seqpar.spawn import run_distributed


def _ask(root: str, calls: str) -> str:
    os.environ["SEQPAR_CACHE"] = root
    from seqpar.hf.cache import converted_dir

    def write(tmp):
        with open(calls, "a") as f:  # one line per conversion
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # long enough that the other processes arrive while this one converts
        (tmp / "weights.bin").write_bytes(b"x" * 1000)

    return str(converted_dir("entry-1", write))


def test_concurrent_first_use_converts_once(tmp_path, monkeypatch):
    # _ask sets $SEQPAR_CACHE in this process too (the last call below): setenv first, so the test's end restores
    # it (a delenv of an unset variable records nothing, and the tmp cache leaked into every later test)
    monkeypatch.setenv("SEQPAR_CACHE", str(tmp_path / "cache"))
    calls = tmp_path / "calls.txt"
    paths = run_distributed(_ask, 3, str(tmp_path / "cache"), str(calls), timeout=300)
    assert len(set(paths)) == 1 and paths[0] == str(tmp_path / "cache" / "entry-1")
    assert len(calls.read_text().splitlines()) == 1
    assert (tmp_path / "cache" / "entry-1" / "weights.bin").read_bytes() == b"x" * 1000
    assert not [p for p in os.listdir(tmp_path / "cache") if ".tmp-" in p]  # no leftovers
    assert _ask(str(tmp_path / "cache"), str(calls)) == paths[0]  # later use: no conversion
    assert len(calls.read_text().splitlines()) == 1


def test_failed_conversion_leaves_no_entry(tmp_path, monkeypatch):
    from seqpar.hf.cache import converted_dir

    monkeypatch.setenv("SEQPAR_CACHE", str(tmp_path))

    def write(tmp):
        (tmp / "half").write_text("partial")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        converted_dir("entry-2", write)
    assert not (tmp_path / "entry-2").exists()
    assert [p for p in os.listdir(tmp_path) if not p.endswith(".lock")] == []


def test_unwritable_cache_names_the_fix(tmp_path, monkeypatch):
    from seqpar import SeqParError
    from seqpar.hf.cache import converted_dir

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SEQPAR_CACHE", str(blocker / "cache"))
    with pytest.raises(SeqParError, match=r"set \$SEQPAR_CACHE to a writable directory"):
        converted_dir("entry-3", lambda tmp: None)


@pytest.mark.slow
def test_smollm2_second_load_uses_cache_and_is_identical(tmp_path, monkeypatch):
    import torch

    from seqpar.hf import load_smollm2, load_smollm2_tokenizer, models

    monkeypatch.setenv("SEQPAR_CACHE", str(tmp_path))
    tok = load_smollm2_tokenizer()  # first use: converts model + tokenizer into the cache
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (entry / "model.safetensors").is_file() and (entry / "tokenizer.json").is_file()

    def no_gguf(*a, **k):
        raise AssertionError("the GGUF was read again although the cache exists")

    with monkeypatch.context() as m:
        m.setattr(models, "_smollm2_from_gguf", no_gguf)
        cached = load_smollm2()
        tok2 = load_smollm2_tokenizer()
    direct = load_smollm2(cache=False)
    a, b = cached.state_dict(), direct.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    ref_tok = load_smollm2_tokenizer(cache=False)
    chat = [{"role": "user", "content": "Why is the sky blue? Answer in one line."},
            {"role": "assistant", "content": "Rayleigh scattering: blue light scatters most."}]
    text = ref_tok.apply_chat_template(chat, tokenize=False)
    for t in (tok, tok2):
        assert t.apply_chat_template(chat, tokenize=False) == text
        assert t(text)["input_ids"] == ref_tok(text)["input_ids"]
        assert (t.eos_token, t.pad_token, len(t)) == (ref_tok.eos_token, ref_tok.pad_token, len(ref_tok))


def test_smollm2_cache_key_follows_content_not_path(tmp_path):
    """One converted SmolLM2 per user: the same GGUF in two virtualenvs (other path, other mtime) shares an entry."""
    import os

    from seqpar.hf.models import _smollm2_cache_key

    blob = bytes(range(256)) * 9000
    a, b, c = tmp_path / "venv1.gguf", tmp_path / "venv2.gguf", tmp_path / "other.gguf"
    a.write_bytes(blob)
    b.write_bytes(blob)
    os.utime(b, (1, 1))
    c.write_bytes(blob[:-1] + b"x")
    assert _smollm2_cache_key(str(a)) == _smollm2_cache_key(str(b)) != _smollm2_cache_key(str(c))
