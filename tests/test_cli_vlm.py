"""`seqpar train` / `seqpar verify` on a vision-language model with chat rows + local image files (train.images)."""

from __future__ import annotations

import json

import pytest
import torch

from seqpar.errors import SeqParError
from seqpar.hf import tiny_config
from seqpar.train.dataset.images import VisionCollator, VisionSpec, build_vision_examples
from seqpar.train.dataset.tokenize import IGNORE
from seqpar.train.model.tokenizers import ByteTokenizer

SIZES = [(16, 24), (24, 16), (16, 16), (32, 24)]  # pixels (h, w): 4-pixel patches, 2x2 merge


def _dataset(tmp_path, n: int = 8) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir(exist_ok=True)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    rows = []
    for i in range(n):
        h, w = SIZES[i % 4]
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(tmp_path / "imgs" / f"{i}.png")
        two = i % 3 == 0
        if two:
            Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(tmp_path / "imgs" / f"{i}b.png")
        user = "Look <image> and " + " ".join(rng.choice(words, 3)) + (" then <image>" if two else "")
        rows.append({"messages": [{"role": "user", "content": user},
                                  {"role": "assistant", "content": " ".join(rng.choice(words, 6))}],
                     "images": [f"imgs/{i}.png"] + ([f"imgs/{i}b.png"] if two else [])})
    path = tmp_path / "vlm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _spec() -> VisionSpec:
    return VisionSpec.from_model_config(tiny_config("qwen2_5_vl", vocab_size=ByteTokenizer.vocab_size))


def test_placeholders_become_image_tokens(tmp_path):
    from seqpar.train.dataset.tokenize import load_rows

    path = _dataset(tmp_path)
    spec = _spec()
    rows = load_rows(path)
    examples, stats = build_vision_examples(rows, "auto", ByteTokenizer(), spec, 256, str(tmp_path))
    assert len(examples) == 8 and stats["truncated"] == 0
    for row, ex in zip(rows, examples):
        ids, labels = torch.tensor(ex["input_ids"]), torch.tensor(ex["labels"])
        grid = ex["image_grid_thw"]
        assert grid.shape == (len(row["images"]), 3)
        assert int((ids == spec.image_token_id).sum()) == int((grid.prod(-1) // 4).sum())  # one per merged patch
        assert int((ids == spec.vision_start_id).sum()) == len(row["images"]) == int((ids == spec.vision_end_id).sum())
        assert ex["pixel_values"].shape[0] == int(grid.prod(-1).sum())
        special = (ids == spec.image_token_id) | (ids == spec.vision_start_id) | (ids == spec.vision_end_id)
        assert bool((labels[special] == IGNORE).all()) and bool((labels != IGNORE).any())
        assert b"<image>" not in bytes(i for i in ex["input_ids"] if i < 256)
    first = SIZES[0]
    assert examples[0]["image_grid_thw"][0].tolist() == [1, first[0] // 4, first[1] // 4]
    batch = VisionCollator(__import__("seqpar").init_mesh(1), ByteTokenizer.pad_token_id)(examples[:2])
    assert torch.equal(batch["full_input_ids"], batch["input_ids"])
    assert batch["pixel_values"].shape[0] == sum(int(e["image_grid_thw"].prod(-1).sum()) for e in examples[:2])


def test_bad_image_rows_refused(tmp_path):
    from seqpar.train.dataset.tokenize import load_rows

    rows = load_rows(_dataset(tmp_path))
    spec = _spec()
    rows[1]["images"] = rows[1]["images"] * 2
    with pytest.raises(SeqParError, match="row 2: 1 <image> placeholders but 2 images"):  # rows[1]: line 2
        build_vision_examples(rows, "auto", ByteTokenizer(), spec, 256, str(tmp_path))
    with pytest.raises(SeqParError, match="an image cannot be cut"):
        build_vision_examples(rows[:1], "auto", ByteTokenizer(), spec, 20, str(tmp_path))
    rows[1]["images"] = ["imgs/missing.png"]
    with pytest.raises(SeqParError, match="cannot read image"):
        build_vision_examples(rows[1:2], "auto", ByteTokenizer(), spec, 256, str(tmp_path))


@pytest.mark.parametrize("over,match", [({"stage": "dpo"}, "stage: sft"),
                                        ({"dataset": {"packing": True}}, "packing: false"),
                                        ({"fsdp": True}, "fsdp: false")])
def test_unsupported_vlm_runs_refused(tmp_path, over, match):
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.checks import refuse_unsupported_model

    d = {"model": {"name": "tiny:qwen2_5_vl"}, "dataset": {"path": _dataset(tmp_path), "max_length": 128}}
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) else v
    if d.get("stage") == "dpo":
        d["dataset"]["format"] = "chat"
    with pytest.raises(SeqParError, match=match):
        cfg = config_from_dict(d, source="test")
        refuse_unsupported_model(cfg)  # before launch (seqpar check / train)
        prepare_examples(cfg)


@pytest.mark.parametrize("sp", [{"size": 2, "ulysses_degree": 2, "ring_degree": 1},
                                pytest.param({"size": 2, "ulysses_degree": 1, "ring_degree": 2},
                                             marks=pytest.mark.slow)])
def test_cli_verify_tiny_qwen2_5_vl(tmp_path, sp):
    """`seqpar verify` (train at SP=2 vs the SP=1 reference, losses and gradients) on chat rows with images:
    B=2 micro-batches, grad-accum 2, rows with one or two images of different sizes."""
    from procs import run_verify

    cfg = {"model": {"name": "tiny:qwen2_5_vl"}, "dataset": {"path": _dataset(tmp_path), "max_length": 128},
           "sequence_parallel": sp, "micro_batch_size": 2, "grad_accum": 2, "max_steps": 2,
           "optimizer": {"lr": 1e-2}, "output_dir": str(tmp_path / "run"), "progress": False}
    rep = run_verify(cfg, tmp_path, steps=2)
    assert rep["passed"] and rep["max_abs_dloss"] <= 1e-5 and rep["grads_passed"], rep
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "verify" / "sp" / "final")  # the export loads in HF
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"


def test_meter_with_text_then_image_micro_batches(tmp_path):
    """The memory meter (on by default) with a text-only micro-batch, then one whose image the vision tower
    encodes before the model's forward (grad-accum 2, one step): it used to raise KeyError in backward."""
    from PIL import Image

    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (16, 16), (200, 30, 60)).save(tmp_path / "imgs" / "a.png")
    rows = [{"messages": [{"role": "user", "content": "no picture here"}, {"role": "assistant", "content": "fine"}]},
            {"messages": [{"role": "user", "content": "Look <image> now"}, {"role": "assistant", "content": "red"}],
             "images": ["imgs/a.png"]}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_from_dict({"model": {"name": "tiny:qwen2_5_vl"},
                            "dataset": {"path": str(tmp_path / "mixed.jsonl"), "max_length": 128, "shuffle": False},
                            "micro_batch_size": 1, "grad_accum": 2, "max_steps": 1, "output_dir": str(tmp_path / "run"),
                            "progress": False, "export": {"final": False}})
    assert cfg.memory.measure
    res = train(cfg)
    assert len(res.losses) == 1 and res.peak_alloc[0]["peak_bytes"] > 0
