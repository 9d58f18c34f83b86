"""A resume finds the run's data again (train/dataset/identity.py): a dataset edited in place with as many rows is
refused, naming the file; other bytes giving the same examples, and the same data at another path, continue
(said); the same file giving other examples (an image edited in place) is refused, saying the file is unchanged; a
run started with `--set dataset.path=F` resumes from the config file that names the same F (both stored and
compared resolved)."""

from __future__ import annotations

import json
import shutil

import pytest

from seqpar.errors import SeqParError

ROWS = [("alpha beta", "gamma delta epsilon"), ("zeta", "eta theta iota kappa"), ("mu nu xi", "omicron pi alpha"),
        ("beta", "delta delta gamma")]


def _write(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"instruction": i, "response": r}) + "\n" for i, r in rows))


def _cfg(data_path, out, max_steps: int) -> dict:
    return {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 2, "num_kv_heads": 1, "num_layers": 1}},
            "dataset": {"path": str(data_path), "max_length": 128}, "micro_batch_size": 2, "max_steps": max_steps,
            "optimizer": {"lr": 1e-2}, "checkpoint": {"every": 1}, "export": {"final": False},
            "output_dir": str(out), "progress": False}


def _train(cfg):
    from seqpar.train.config import TrainConfig, config_from_dict
    from seqpar.train.run import train

    return train(cfg if isinstance(cfg, TrainConfig) else config_from_dict(cfg))


def test_edited_data_refused_moved_data_continues(tmp_path, capsys):
    data = tmp_path / "data" / "sft.jsonl"
    _write(data, ROWS)
    out = tmp_path / "run"
    assert _train(_cfg(data, out, 1)).resumed_from is None
    record = json.loads((out / "checkpoint-1" / "run.json").read_text())["data"]
    assert record["rows"] == 4 and record["path"] == str(data.resolve()), record
    # Edited in place, as many rows: refused, naming the file and that the row count is the same.
    _write(data, [(i, r + " omega") for i, r in ROWS])
    with pytest.raises(SeqParError) as e:
        _train(_cfg(data, out, 2))
    msg = str(e.value)
    assert "cannot resume from" in msg and f"the dataset file(s) at {data.resolve()} changed since that run" in msg, msg
    assert "examples)" not in msg and "restore that dataset, or start fresh" in msg, msg
    # Restored with other JSON spacing: other bytes, the same examples: the run continues, and says so.
    data.write_text("".join(json.dumps({"instruction": i, "response": r}, separators=(",", ":")) + "\n"
                            for i, r in ROWS))
    capsys.readouterr()
    assert _train(_cfg(data, out, 2)).resumed_from == 1
    said = capsys.readouterr().out
    assert f"the dataset file(s) at {data.resolve()} changed since that run, but not the examples" in said, said
    # Moved elsewhere: the same data, so the run continues, and says so.
    moved = tmp_path / "elsewhere" / "copy.jsonl"
    moved.parent.mkdir()
    shutil.copy(data, moved)
    assert _train(_cfg(moved, out, 3)).resumed_from == 2
    said = capsys.readouterr().out
    assert f"dataset.path: {str(data.resolve())!r} -> {str(moved.resolve())!r}: the same data" in said, said
    assert "changed since that run" not in said, said
    # Another path with other content (one row more): both said.
    third = tmp_path / "third" / "more.jsonl"
    _write(third, ROWS + [("pi", "rho")])
    with pytest.raises(SeqParError, match=r"dataset.path: .*copy.jsonl' -> .*more.jsonl', with other content "
                                          r"\(4 -> 5 examples\)"):
        _train(_cfg(third, out, 4))


def test_set_dataset_path_resumes_from_the_config_file(tmp_path, monkeypatch):
    """`--set dataset.path=data/sft.jsonl` (relative to the working directory) and a config file naming the same file
    relative to itself (../data/sft.jsonl): one path, stored absolute both ways; the second run resumes."""
    from seqpar.train.config import load_config

    _write(tmp_path / "data" / "sft.jsonl", ROWS)
    conf = tmp_path / "conf"
    conf.mkdir()
    y = conf / "run.yaml"
    cfg = _cfg("../data/sft.jsonl", "../run", 1)
    y.write_text(json.dumps(cfg))  # JSON is YAML
    monkeypatch.chdir(tmp_path)
    first = load_config(y, {"dataset.path": "data/sft.jsonl"})
    second = load_config(y, {"max_steps": 2})
    assert first.dataset.path == str(tmp_path / "data" / "sft.jsonl"), first.dataset.path  # absolute, not raw
    assert _train(first).resumed_from is None
    assert _train(second).resumed_from == 1


def test_config_differences_compare_paths_resolved(tmp_path, monkeypatch):
    """A checkpoint from before the data's identity was recorded may hold a raw relative dataset.path: it is the same
    path as the absolute one (resolved against the working directory); another file is still named."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.lifecycle.resume import config_differences

    _write(tmp_path / "data" / "sft.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    now = config_from_dict(_cfg(tmp_path / "data" / "sft.jsonl", tmp_path / "run", 1))
    saved = config_from_dict(_cfg("data/sft.jsonl", tmp_path / "run", 1)).model_dump(mode="json")
    assert config_differences(saved, now) == []
    other = config_from_dict(_cfg("data/other.jsonl", tmp_path / "run", 1)).model_dump(mode="json")
    assert config_differences(other, now) == [f"dataset.path: 'data/other.jsonl' -> '{tmp_path}/data/sft.jsonl'"]
    assert config_differences(other, now, skip=("dataset.path",)) == []


def test_identity_sees_an_image_edited_in_place(tmp_path):
    """The JSONL is unchanged, one image it names is not: the examples' fingerprint differs (their pixels), and the
    message says the file is unchanged and names the tokenizer / template / images as what changed."""
    import numpy as np
    from PIL import Image

    from seqpar.hf import tiny_config
    from seqpar.train.dataset.identity import data_identity, fingerprint
    from seqpar.train.dataset.images import VisionSpec, build_vision_examples
    from seqpar.train.dataset.tokenize import load_rows
    from seqpar.train.model.tokenizers import ByteTokenizer

    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    for i in range(2):
        Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(tmp_path / "imgs" / f"{i}.png")
    path = tmp_path / "vlm.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Look <image> here"},
                                                     {"role": "assistant", "content": "alpha beta"}],
                                        "images": [f"imgs/{i}.png"]}) + "\n" for i in range(2)))
    spec = VisionSpec.from_model_config(tiny_config("qwen2_5_vl", vocab_size=ByteTokenizer.vocab_size))

    def identity():
        ex, _ = build_vision_examples(load_rows(str(path)), "auto", ByteTokenizer(), spec, 256, str(tmp_path))
        return ex, data_identity(str(path), ex)

    ex, before = identity()
    assert fingerprint(ex) == before.examples and identity()[1] == before  # deterministic
    assert before.changes(before.meta()) == ([], [])
    Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(tmp_path / "imgs" / "1.png")
    _, after = identity()
    assert after.files == before.files and after.examples != before.examples
    refusals, notes = after.changes(before.meta())
    assert notes == [] and len(refusals) == 1, refusals
    assert f"its examples differ though the dataset file(s) at {path.resolve()} are unchanged" in refusals[0]
    assert "images / videos the rows name" in refusals[0], refusals[0]


def test_fingerprint_sees_structure_and_values():
    """Token ids, labels, tensors (dtype, shape, values), dataclass fields, order and nesting all count."""
    import torch

    from seqpar.train.dataset.identity import fingerprint
    from seqpar.train.dataset.prompts import PromptRow

    base = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4], "labels": [4]}]
    variants = [
        [{"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}, {"input_ids": [4], "labels": [4]}],
        list(reversed(base)),
        [base],  # packed: one row of both
        [{"input_ids": [1, 2], "labels": [-100, 2]}, {"input_ids": [3, 4], "labels": [3, 4]}],
    ]
    prints = {fingerprint(base)} | {fingerprint(v) for v in variants}
    assert len(prints) == 1 + len(variants)
    t = torch.arange(6.0).view(2, 3)
    tensors = [t, t.double(), t.view(3, 2), t + 1e-6, t.t().contiguous()]
    assert len({fingerprint([{"pixel_values": x}]) for x in tensors}) == len(tensors)
    row = PromptRow("hi", [1, 2], {"answer": "4"})
    assert fingerprint([row]) != fingerprint([PromptRow("hi", [1, 2], {"answer": "5"})])
    assert fingerprint([row]) == fingerprint([PromptRow("hi", [1, 2], {"answer": "4"})])


def test_dataset_file_hashed_once_and_handed_to_the_ranks(tmp_path, monkeypatch):
    """The launcher's checks hash the file and hand the result on (SEQPAR_DATA_SHA256); a rank (another process:
    an empty memo) reads nothing; a second identity in one process reads nothing; a changed file is read again."""
    import os
    import time

    from seqpar.train.dataset import identity as ident

    data = tmp_path / "d.jsonl"
    _write(data, ROWS)
    reads = []
    real = ident._hash_files
    monkeypatch.setattr(ident, "_hash_files", lambda files: reads.append(files) or real(files))
    monkeypatch.setattr(ident, "_KNOWN", {})
    monkeypatch.delenv(ident.DATA_HASH_ENV, raising=False)
    want = real(ident.dataset_files(str(data)))
    ident.export_file_hash(str(data))  # the launcher
    assert len(reads) == 1 and json.loads(os.environ[ident.DATA_HASH_ENV])["sha256"] == want
    monkeypatch.setattr(ident, "_KNOWN", {})  # a rank: its own process
    assert [ident.data_identity(str(data), []).files for _ in range(3)] == [want] * 3 and len(reads) == 1
    _write(data, ROWS[:2])
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert ident.file_hash(str(data)) != want and len(reads) == 2
