"""`seqpar train` / `seqpar verify` on a vision-language model with chat rows + local image files and videos (frame
folders, GIFs; train.dataset.images / videos)."""

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


def _video_dataset(tmp_path, n: int = 6) -> str:
    """Rows with a video (a frame folder of 3 or 4 frames, or a 4-frame GIF), some with an image as well, one
    text-only; frames are random noise saved as PNG / GIF."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    rows = []
    for i in range(n):
        clip = tmp_path / "clips" / f"c{i}"
        clip.mkdir(parents=True, exist_ok=True)
        h, w = SIZES[i % 4]
        frames = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for _ in range(3 + i % 2)]
        if i % 3 == 2:
            frames[0].save(tmp_path / "clips" / f"c{i}.gif", save_all=True, append_images=frames[1:], duration=250)
            video = f"clips/c{i}.gif"
        else:
            for k, f in enumerate(frames):
                f.save(clip / f"{k:03d}.png")
            video = {"path": f"clips/c{i}", "fps": 1.0 + i % 2}
        user = "Watch <video> " + " ".join(rng.choice(words, 3))
        row = {"messages": [{"role": "user", "content": user},
                            {"role": "assistant", "content": " ".join(rng.choice(words, 5))}], "videos": [video]}
        if i % 2:
            Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(tmp_path / "clips" / f"i{i}.png")
            row["messages"][0]["content"] += " and <image>"
            row["images"] = [f"clips/i{i}.png"]
        rows.append(row)
    rows.append({"messages": [{"role": "user", "content": "no media"}, {"role": "assistant", "content": "fine"}]})
    path = tmp_path / "video.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


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
    with pytest.raises(SeqParError, match="an image or video cannot be cut"):
        build_vision_examples(rows[:1], "auto", ByteTokenizer(), spec, 20, str(tmp_path))
    rows[1]["images"] = ["imgs/missing.png"]
    with pytest.raises(SeqParError, match="cannot read image"):
        build_vision_examples(rows[1:2], "auto", ByteTokenizer(), spec, 256, str(tmp_path))


def test_media_rows_on_a_text_model_refused(tmp_path):
    """SFT and DPO rows with images / videos on a text-only model are refused (as GRPO's are), naming the file and
    row: they were trained with the media dropped and `<image>` as text. The eval_dataset too; empty media columns
    and text-only rows are fine."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples

    sft = _dataset(tmp_path, n=3)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "hello", "chosen": "a", "rejected": "b", "images": []}) + "\n"
                     + json.dumps({"prompt": "see <video>", "chosen": "a", "rejected": "b", "videos": ["clips/c"]})
                     + "\n")
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"instruction": "hi", "output": "there", "images": None}) + "\n")

    def cfg(path, stage="sft", eval_path=None):
        d = {"model": {"name": "tiny:llama"}, "dataset": {"path": str(path), "max_length": 128}, "stage": stage}
        if eval_path is not None:
            d["eval_dataset"] = {"path": str(eval_path), "max_length": 128}
        return config_from_dict(d, source="test")

    with pytest.raises(SeqParError, match=f"dataset {sft}: row 1 carries images/videos, but the model is text-only: "
                                          "they would be dropped and their <image> / <video> placeholders trained"):
        prepare_examples(cfg(sft))
    with pytest.raises(SeqParError, match=f"dataset {pairs}: row 2 carries images/videos, but the model is text-only"):
        prepare_examples(cfg(pairs, "dpo"))
    assert len(prepare_examples(cfg(text))[0]) == 1
    ev = cfg(text, eval_path=sft)
    with pytest.raises(SeqParError, match=f"eval_dataset {sft}: row 1 carries images/videos"):
        prepare_examples(ev, spec=ev.eval_dataset)


@pytest.mark.parametrize("over,match", [({"stage": "dpo"}, "stage: dpo needs rows with prompt, chosen and rejected")])
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


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_videos_become_video_tokens(tmp_path, arch):
    """Frame folders and GIFs: patches in Qwen2-VL's video layout (2 identical frames = the image's patches),
    one run of video tokens per video (Qwen3-VL: per temporal patch, after its `<t seconds>` timestamp), timing."""
    from PIL import Image

    from seqpar.train.dataset.tokenize import load_rows
    from seqpar.train.dataset.videos import video_patches

    spec = VisionSpec.from_model_config(tiny_config(arch, vocab_size=ByteTokenizer.vocab_size))
    rows = load_rows(_video_dataset(tmp_path))
    examples, _ = build_vision_examples(rows, "auto", ByteTokenizer(), spec, 512, str(tmp_path))
    for row, ex in zip(rows, examples):
        ids = torch.tensor(ex["input_ids"])
        if "videos" not in row:
            assert "video_grid_thw" not in ex
            continue
        grid = ex["video_grid_thw"]
        assert grid.shape == (1, 3) and ex["pixel_values_videos"].shape == (int(grid.prod()), 3 * 2 * 4 * 4)
        assert int((ids == spec.video_token_id).sum()) == int(grid.prod()) // 4
        fps = row["videos"][0]["fps"] if isinstance(row["videos"][0], dict) else 4.0  # GIF: 250 ms per frame
        assert ex["second_per_grid_ts"] == [2 / fps]
        starts = int((ids == spec.vision_start_id).sum()) - ("images" in row)
        assert starts == (int(grid[0, 0]) if arch == "qwen3_vl" else 1)
        if arch == "qwen3_vl":  # the first temporal patch: frames 0 and 1 -> the mean of 0 and 1 / fps
            assert f"<{0.5 / fps:.1f} seconds>".encode() in bytes(t for t in ex["input_ids"] if t < 256)
    im = Image.new("RGB", (24, 16), (10, 200, 30))
    x, grid = video_patches(spec.processor, [im, im], 2)
    out = spec.processor(images=[im], return_tensors="pt")
    assert grid == out["image_grid_thw"][0].tolist() and torch.equal(x, out["pixel_values"])


def test_video_files_refused_with_frame_folders_named(tmp_path):
    from seqpar.train.dataset.videos import read_frames

    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 16)
    with pytest.raises(SeqParError, match="Extract its frames into a folder"):
        read_frames("clip.mp4", str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SeqParError, match="holds no frames"):
        read_frames({"path": "empty", "fps": 2}, str(tmp_path))
    with pytest.raises(SeqParError, match="fps must be a positive number"):
        read_frames({"path": "empty", "fps": 0}, str(tmp_path))


@pytest.mark.parametrize("arch,sp,extra", [
    ("qwen2_5_vl", {"size": 2, "ulysses_degree": 2, "ring_degree": 1},
     {"fsdp": True, "packing": True}),
    pytest.param("qwen3_vl", {"size": 2, "ulysses_degree": 1, "ring_degree": 2},
                 {"memory": {"activation_checkpointing": True, "fused_loss": True}}, marks=pytest.mark.slow)])
def test_cli_verify_videos(tmp_path, arch, sp, extra):
    """`seqpar verify` (SP=2 vs the SP=1 reference: losses and step-1 gradients) on rows with videos (frame folders,
    a GIF), images and none: fast: Qwen2.5-VL, Ulysses, FSDP2 (vision blocks sharded: a rank without media encodes
    a blank image) and packed rows; slow: Qwen3-VL (timestamps), ring, checkpointing (vision blocks too)."""
    from procs import run_verify

    ds = {"path": _video_dataset(tmp_path), "max_length": 256 if extra.get("packing") else 160}
    if extra.get("packing"):
        ds["packing"] = True
    cfg = {"model": {"name": f"tiny:{arch}"}, "dataset": ds, "sequence_parallel": sp,
           "micro_batch_size": 1 if extra.get("packing") else 2, "grad_accum": 2, "max_steps": 2,
           "optimizer": {"lr": 1e-2}, "output_dir": str(tmp_path / "run"), "progress": False}
    cfg.update({k: v for k, v in extra.items() if k != "packing"})
    rep = run_verify(cfg, tmp_path, steps=2)
    assert rep["passed"] and rep["max_abs_dloss"] <= 1e-5 and rep["grads_passed"], rep


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
