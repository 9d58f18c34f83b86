"""`seqpar export CKPT OUT` never destroys a run nor anything it did not write (one process, in-process CLI).

OUT that is, or sits inside, a run's output_dir or a checkpoint is refused, --overwrite or not; an existing OUT
must be empty or an earlier export, which only --overwrite replaces, and only when it holds nothing else.
Every refusal is one `seqpar: error:` line with exit code 2, and leaves every file as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import write_sft_rows

from seqpar.cli.main import main


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints 1 and 2, final/, metrics.jsonl, loss.png, latest."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    root = tmp_path_factory.mktemp("export_dest")
    data = write_sft_rows(root)
    out = root / "runs" / "x"
    train(config_from_dict({
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 1}},
        "dataset": {"path": str(data / "sft.jsonl"), "max_length": 64}, "micro_batch_size": 2, "max_steps": 2,
        "optimizer": {"lr": 1e-2}, "checkpoint": {"every": 1, "keep_last": 2}, "output_dir": str(out),
        "progress": False, "memory": {"measure": False}}))
    return out


def _tree(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _export(capsys, ckpt: Path, out: Path, *flags: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["export", str(ckpt), str(out), *flags])
    return code, capsys.readouterr().err.strip()


def _refused(capsys, ckpt: Path, out: Path, *flags: str, says: str) -> str:
    code, err = _export(capsys, ckpt, out, *flags)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("seqpar: error: "), (code, err)
    assert says in err, err
    return err


def test_export_never_writes_into_a_run(run, capsys):
    """The run's own output_dir (the issue's case: it used to delete both checkpoints, metrics, final/), with and
    without --overwrite, a checkpoint, final/, a folder inside a checkpoint, a link to the run: all refused, the
    run untouched."""
    before = _tree(run.parent)
    ckpt = run / "checkpoint-2"
    err = _refused(capsys, ckpt, run, says="is a run's output_dir")
    assert "with or without --overwrite" in err and str(run.parent / "x-export") in err, err
    _refused(capsys, ckpt, run, "--overwrite", says="is a run's output_dir")
    _refused(capsys, ckpt, run / "checkpoint-1", "--overwrite", says="is a checkpoint")
    _refused(capsys, ckpt, ckpt, says="is a checkpoint")
    _refused(capsys, ckpt, run / "final", "--overwrite", says=f"is inside {run}, a run's output_dir")
    _refused(capsys, ckpt, ckpt / "sub" / "out", says=f"is inside {ckpt}, a checkpoint")
    link = run.parent / "link"
    link.symlink_to(run, target_is_directory=True)
    try:
        _refused(capsys, ckpt, link / "new", says=f"is inside {run}")
    finally:
        link.unlink()
    # The folder holding the run (it contains one): not an export, so nothing in it is replaced.
    _refused(capsys, ckpt, run.parent, "--overwrite", says="did not write")
    assert _tree(run.parent) == before


def test_export_replaces_only_its_own_earlier_export(run, tmp_path, capsys):
    ckpt = run / "checkpoint-2"
    keep = tmp_path / "out.tmp"  # the name the export's temporary folder used to have (it deleted it first)
    keep.mkdir()
    (keep / "mine.txt").write_text("keep")
    out = tmp_path / "out"
    code, err = _export(capsys, ckpt, out)
    assert code == 0, err
    files = json.loads((out / "seqpar_export.json").read_text())["files"]
    assert sorted(files) == sorted(_tree(out)) and "config.json" in files, files
    assert (keep / "mine.txt").read_text() == "keep"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.export-")]  # no temporary folder left
    _refused(capsys, ckpt, out, says="already holds an export")  # replacing it needs --overwrite
    code, err = _export(capsys, run / "checkpoint-1", out, "--overwrite")
    assert code == 0, err
    assert json.loads((out / "seqpar_export.json").read_text())["step"] == 1
    (out / "notes.md").write_text("my notes")  # not the export's: --overwrite must not delete it
    _refused(capsys, ckpt, out, "--overwrite", says="files it did not write (notes.md)")
    assert (out / "notes.md").read_text() == "my notes"


def test_export_into_folders_it_did_not_write(run, tmp_path, capsys):
    ckpt = run / "checkpoint-2"
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_bytes(b"\x00\x01")
    _refused(capsys, ckpt, other, "--overwrite", says="did not write (data.bin)")
    assert (other / "data.bin").read_bytes() == b"\x00\x01"
    a_file = tmp_path / "model.txt"
    a_file.write_text("x")
    _refused(capsys, ckpt, a_file, says="is a file, not a folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _export(capsys, ckpt, empty)  # an empty folder is written into
    assert code == 0 and (empty / "seqpar_export.json").is_file(), err
