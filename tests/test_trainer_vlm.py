"""`seqpar.hf.SequenceParallelTrainer` on a vision-language model under FSDP2, against the stock Trainer.

One script, run (a) with the stock `transformers.Trainer` on one process (plain fp32, the model's own image /
video path and loss: an independent reference) and (b) with `SequenceParallelTrainer` under torchrun on 2
ranks, SP = 2, `fsdp="full_shard", fsdp_config={"fsdp_version": 2}` wrapping every decoder layer AND every vision
block (transformers' _no_split_modules). Rows are the processor's output (input_ids with expanded placeholders,
labels, pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw / second_per_grid_ts) of a tiny
Qwen2.5-VL: rows with one image, two images, a video, and none, so some micro-batches give one SP rank no image
(it encodes a blank one so FSDP2's gathers match) and some have no media at all. SGD lr 0.1, batch 2, grad-accum 1
(the stock VL model normalises per micro-batch), 4 steps: every logged loss to 1e-5 absolute, every step's
gradient norm to 1e-5 relative, and every final parameter (vision tower included; gathered from the FSDP2 shards)
to 1e-5 of the stock run's, which moved.
"""

from __future__ import annotations

import json
import sys

from procs import FULL_PARAMS_SCRIPT, check_params, run_script

SCRIPT = r'''
import json, os, sys
import torch, datasets
from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments
from seqpar.hf.trainer import SequenceParallelTrainer
sys.path.insert(0, sys.argv[4])
from vlm_cases import Doc, SECONDS, media_kwargs

mode, out, model_dir = sys.argv[1:4]
''' + FULL_PARAMS_SCRIPT + r'''
g = torch.Generator().manual_seed(0)
specs = [[("text", 9), ("image", (1, 4, 4)), ("text", 12)], [("text", 20)],
         [("text", 5), ("image", (1, 2, 4)), ("text", 6), ("image", (1, 4, 2)), ("text", 8)], [("text", 14)],
         [("text", 6), ("video", (2, 4, 4)), ("text", 10)], [("text", 30)],
         [("text", 18)], [("text", 4), ("image", (1, 2, 2)), ("text", 9)]]
rows = []
for spec in specs:
    d = Doc(spec, "qwen2_5_vl", g)
    row = {"input_ids": d.ids.tolist(), "labels": d.labels.tolist(), "pixel_values": None, "image_grid_thw": None,
           "pixel_values_videos": None, "video_grid_thw": None, "second_per_grid_ts": None}  # one schema for all
    for k, v in media_kwargs([d]).items():
        row[k] = v.tolist()
    if d.videos:
        row["second_per_grid_ts"] = [SECONDS]
    rows.append(row)
ds = datasets.Dataset.from_list(rows)

def stock_collate(batch):
    m = max(len(r["input_ids"]) for r in batch)
    ids = torch.tensor([r["input_ids"] + [0] * (m - len(r["input_ids"])) for r in batch])
    out = {"input_ids": ids, "labels": torch.tensor([r["labels"] + [-100] * (m - len(r["labels"])) for r in batch]),
           "mm_token_type_ids": (ids == 160).int() + 2 * (ids == 161).int()}
    for pix, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        have = [r for r in batch if r.get(grid)]
        if have:
            out[pix] = torch.cat([torch.tensor(r[pix]) for r in have])
            out[grid] = torch.cat([torch.tensor(r[grid]) for r in have])
    ts = [t for r in batch for t in (r.get("second_per_grid_ts") or [])]
    if ts:
        out["second_per_grid_ts"] = torch.tensor(ts)
    return out

kw = {}
if mode == "sp":
    kw.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
args = TrainingArguments(output_dir=f"{out}/run", per_device_train_batch_size=2, gradient_accumulation_steps=1,
                         max_steps=4, logging_steps=1, report_to=[], save_strategy="no",
                         train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True,
                         optim="sgd", learning_rate=0.1, max_grad_norm=1.0, remove_unused_columns=False, **kw)
model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
if mode == "sp":
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=ds, sequence_parallel_size=2)
else:
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=stock_collate)
    torch.save(full_params(model), f"{out}/ref/init_params.pt")
trainer.train()
params = full_params(trainer.model)  # every rank: FSDP2's full_tensor is a collective
if int(os.environ.get("RANK", "0")) == 0:
    torch.save(params, f"{out}/{mode}/params.pt")
res = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
       "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
       "vision_units": sum(type(m).__name__.startswith("FSDP") and type(m).__name__.endswith("VisionBlock")
                           for m in trainer.model_wrapped.modules())}
if int(os.environ.get("RANK", "0")) == 0:
    json.dump(res, open(f"{out}/{mode}.json", "w"))
'''


def test_trainer_fsdp2_vlm_matches_stock_trainer(tmp_path):
    from pathlib import Path

    from seqpar.hf import tiny_model

    tiny_model("qwen2_5_vl", seed=0).save_pretrained(tmp_path / "model")
    (tmp_path / "ref").mkdir()
    (tmp_path / "sp").mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    tests = str(Path(__file__).parent)
    run_script([sys.executable, str(tmp_path / "train.py"), "ref", str(tmp_path), str(tmp_path / "model"), tests],
               tmp_path, tmp_path / "ref.json")
    run_script([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(tmp_path / "train.py"),
                "sp", str(tmp_path), str(tmp_path / "model"), tests], tmp_path, tmp_path / "sp.json", timeout=600)
    ref, sp = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("ref", "sp"))
    assert sp["vision_units"] == 2, sp  # every vision block is its own FSDP2 unit
    assert len(sp["losses"]) == len(ref["losses"]) == 4
    for a, b in zip(sp["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5, (sp, ref)
    for a, b in zip(sp["grad_norms"], ref["grad_norms"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (sp, ref)
    check_params(tmp_path / "sp", tmp_path / "ref")
