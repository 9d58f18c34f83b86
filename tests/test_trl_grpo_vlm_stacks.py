"""seqpar.trl.SequenceParallelGRPOTrainer with image prompts under FSDP2 and DeepSpeed ZeRO-3 vs the STOCK
trl.GRPOTrainer.

The reference: stock `trl.GRPOTrainer` on one process (no SP, no FSDP / DeepSpeed), the test's; the SP run:
the seqpar class under torchrun, 2 ranks, SP = 2, the stack given in the config (`fsdp="full_shard"` with
fsdp_version 2: accelerate wraps every decoder layer AND every vision block; or `deepspeed={...}` ZeRO-3 with
stage3_param_persistence_threshold 0, the model loaded after the config so ZeRO-3 partitions it at load). The same
tiny Qwen2.5-VL, processor and conversations as tests/test_trl_grpo_vlm.py, but every other row has no image
(TRL's "images" column, an empty list), so some generation batches give one SP rank a share without an image.

(1) Training: `_generate_single_turn` replaced in both runs by a deterministic function of the prompt ids (the seqpar
class still shares the rows over the SP group with their images); SGD lr 0.1, 2 steps: every logged loss at 1e-5
absolute and every final parameter (vision tower included; gathered from the shards) at fp32 1e-5 of the stock
run's, which moved. (2) Rollouts with the real generate() (greedy: TRL's generation_kwargs do_sample False) after
training, on 4 rows whose first prompt group has an image and second none: SP rank 0 samples the image rows, SP
rank 1 the text rows and runs the tower on a blank image in its prefill (FSDP2: the vision blocks' gathers match);
the completions equal the stock trainer's, which differ without the image (the rollouts see it). Fast: FSDP2 at
beta 0; slow: ZeRO-3 (beta 0 and 0.2), FSDP2 at beta 0.2, as a ring (SP 2) and at dp 2 x SP 1 (a dp rank
whose rollout rows are text only); a tiny Qwen3-VL under FSDP2 as a ring and under ZeRO-3.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from procs import FULL_PARAMS_SCRIPT, check_params, run_script

SCRIPT = r'''
import json, os, sys
import torch, trl
from transformers import AutoModelForImageTextToText
sys.path.insert(0, sys.argv[6])
from test_trl_grpo_vlm import _processor, _fake_generate, images_and_texts, reward_chars
import seqpar.hf.rollout_media as rollout_media
from trl.data_utils import prepare_multimodal_messages

mode, stack, out, model_dir, beta = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
layout = sys.argv[7] if len(sys.argv) > 7 else ""  # "ring" (SP 2 as a ring) or "dp2" (dp 2 x SP 1)
''' + FULL_PARAMS_SCRIPT + r'''
rank = int(os.environ.get("RANK", "0"))

def dataset():
    import datasets
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": text}],
                                        "images": [img] if i % 2 == 0 else []}
                                       for i, (img, text) in enumerate(images_and_texts())])

real_generate = trl.GRPOTrainer._generate_single_turn
trl.GRPOTrainer._generate_single_turn = _fake_generate
stock_generate = trl.GRPOTrainer._generate

def generate_listing_no_images(self, prompts):
    """Stock TRL 1.16 returns None for a row without images, and its processor call then fails on a batch mixing
    rows with and without images: [] instead (both runs), so generation batches may mix them."""
    out = list(stock_generate(self, prompts))
    out[6] = None if out[6] is None else [x or [] for x in out[6]]
    return tuple(out)

trl.GRPOTrainer._generate = generate_listing_no_images
kw = {}
if stack == "zero3":
    kw["deepspeed"] = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                       "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}
elif stack == "fsdp2":
    kw.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
batch = 8 if layout == "dp2" and mode == "plain" else 4  # the stock batch holds every dp rank's rows
args = trl.GRPOConfig(output_dir=f"{out}/run", per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                      max_steps=2, num_generations=2, max_completion_length=8, logging_steps=1, report_to=[],
                      save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=False, optim="sgd",
                      learning_rate=0.1, max_grad_norm=1.0, beta=beta, loss_type="grpo",
                      gradient_checkpointing=False, generation_kwargs={"do_sample": False}, **kw)
model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)  # after the config (ZeRO-3)
ds = dataset()
if mode == "plain":
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_chars, args=args, train_dataset=ds,
                              processing_class=_processor())
    torch.save(full_params(trainer.model), f"{out}/init_params.pt")
else:
    from seqpar.trl import SequenceParallelGRPOTrainer
    sp_kw = {"ring": {"ring_degree": 2, "ulysses_degree": 1}, "dp2": {"sequence_parallel_size": 1}}.get(layout, {})
    trainer = SequenceParallelGRPOTrainer(model=model, reward_funcs=reward_chars, args=args, train_dataset=ds,
                                          processing_class=_processor(), **{"sequence_parallel_size": 2, **sp_kw})
trainer.train()
params = full_params(trainer.model)  # every rank: a collective under ZeRO-3 / FSDP2
if rank == 0:
    torch.save(params, f"{out}/params.pt")

# (2) real rollouts: the first prompt group with an image, the second without
blanks = []
tower = rollout_media.blank_tower_pass
rollout_media.blank_tower_pass = lambda vlm: (blanks.append(1), tower(vlm))[1]
trl.GRPOTrainer._generate_single_turn = real_generate

def rollout(with_image):
    rows = [ds[0], ds[0], ds[1], ds[1]] if mode == "plain" or layout != "dp2" else [ds[rank]] * 2  # dp2: own rows
    prompts = [prepare_multimodal_messages(r["prompt"], images=r["images"] if with_image else []) for r in rows]
    ids, images, fields = trainer._tokenize_prompts(prompts)
    return trainer._generate_single_turn(ids, images, fields, 2)[0]

completions = rollout(True)
log = trainer.state.log_history
res = {"losses": [h["loss"] for h in log if "loss" in h], "completions": completions, "blanks": len(blanks),
       "wrapped": type(trainer.model_wrapped).__name__,
       "vision_units": sum(type(m).__name__.startswith("FSDP") and type(m).__name__.endswith("VisionBlock")
                           for m in trainer.model_wrapped.modules()),
       "sharded": any(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for p in trainer.model_wrapped.parameters())}
if mode == "plain":
    res["without_image"] = rollout(False)
if mode != "plain":
    import torch.distributed as dist
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (len(blanks), completions))
    res["blanks_per_rank"] = [b for b, _ in every]
    if layout == "dp2":
        res["completions"] = [c for _, cs in every for c in cs]
if rank == 0:
    json.dump(res, open(f"{out}/result.json", "w"))
'''


def _run_here(cmd: list[str]) -> None:
    """The stock reference in this process (as tests/test_trl_grpo_vlm.py runs it): no interpreter start or imports
    to pay for; what the script patches is put back."""
    import runpy

    import trl

    import seqpar.hf.rollout_media as rollout_media

    saved = sys.argv, trl.GRPOTrainer._generate_single_turn, trl.GRPOTrainer._generate, rollout_media.blank_tower_pass
    sys.argv = cmd
    try:
        runpy.run_path(cmd[0], run_name="__main__")
    finally:
        (sys.argv, trl.GRPOTrainer._generate_single_turn, trl.GRPOTrainer._generate,
         rollout_media.blank_tower_pass) = saved


def _launch(tmp_path, mode: str, stack: str = "none", beta: float = 0.0, layout: str = "",
            arch: str = "qwen2_5_vl") -> dict:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    model_dir = tmp_path / f"model-{arch}"
    if not model_dir.exists():  # saved once, before any launch (ranks would race to write it)
        from seqpar.hf import tiny_model

        tiny_model(arch, 4, 2, vocab_size=49152, seed=0).save_pretrained(model_dir)
    out = tmp_path / f"{mode}-{stack}-{beta}-{layout}"
    out.mkdir()
    cmd = [str(script), mode, stack, str(out), str(model_dir), str(beta), str(Path(__file__).parent),
           layout]
    if mode == "plain":
        _run_here(cmd)
    else:
        cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *cmd]
        run_script([sys.executable, *cmd], tmp_path, result=out / "result.json", timeout=500)
    return {**json.loads((out / "result.json").read_text()), "dir": str(out)}


def _case(tmp_path, stack: str, beta: float, layout: str = "", arch: str = "qwen2_5_vl") -> None:
    ref = _launch(tmp_path, "plain", beta=beta, layout=layout, arch=arch)
    sp = _launch(tmp_path, "sp", stack, beta, layout, arch)
    print("losses", sp["losses"], ref["losses"], "completions", sp["completions"], ref["completions"])
    assert len(sp["losses"]) == len(ref["losses"]) == 2
    assert max(abs(a - b) for a, b in zip(sp["losses"], ref["losses"])) <= 1e-5, (sp, ref)
    print("max |dparam|", check_params(sp["dir"], ref["dir"]))  # every parameter, vision tower included; moved
    init, final = (torch.load(Path(ref["dir"]) / f) for f in ("init_params.pt", "params.pt"))
    assert max(float((final[k] - v).abs().max()) for k, v in init.items() if "visual" in k) > 1e-4  # images trained
    assert sp["sharded"], sp
    assert sp["wrapped"] == "DeepSpeedEngine" if stack == "zero3" else sp["vision_units"] == 2, sp
    # real rollouts: the image rows on SP rank 0, the text rows on SP rank 1 (FSDP2: a blank tower pass there)
    assert sp["completions"] == ref["completions"], (sp["completions"], ref["completions"])
    assert ref["completions"][:2] != ref["without_image"][:2], ref  # the image changes the rollout
    assert sp["blanks_per_rank"] == ([0, 1] if stack == "fsdp2" else [0, 0]), sp


def test_grpo_image_prompts_fsdp2_matches_stock_trl(tmp_path):
    _case(tmp_path, "fsdp2", 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("stack, beta, layout, arch", [
    ("zero3", 0.0, "", "qwen2_5_vl"), ("zero3", 0.2, "", "qwen2_5_vl"), ("fsdp2", 0.2, "", "qwen2_5_vl"),
    ("fsdp2", 0.0, "ring", "qwen2_5_vl"), ("fsdp2", 0.0, "dp2", "qwen2_5_vl"), ("fsdp2", 0.0, "ring", "qwen3_vl"),
    ("zero3", 0.0, "", "qwen3_vl")])
def test_grpo_image_prompts_stacks_match_stock_trl(tmp_path, stack, beta, layout, arch):
    """dp2: dp 2 x SP 1 (stock batch 8); in the rollout check dp rank 1 holds only the text prompt's rows."""
    _case(tmp_path, stack, beta, layout, arch)


def test_zero3_per_module_fetch_with_images_is_refused():
    """ZeRO-3 with ds3_gather_for_generation=False and a VL model: refused (naming the way out); TRL's default gather,
    a text model, or ZeRO-2 pass."""
    from types import SimpleNamespace

    from seqpar.errors import SeqParError
    from seqpar.trl.grpo_media import refuse_fetched_media

    def trainer(stage: int, gather: bool):
        state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage))
        return SimpleNamespace(accelerator=SimpleNamespace(state=state),
                               args=SimpleNamespace(ds3_gather_for_generation=gather))

    with pytest.raises(SeqParError, match="leave ds3_gather_for_generation=True"):
        refuse_fetched_media(trainer(3, False), vlm=True)
    for t, vlm in ((trainer(3, True), True), (trainer(3, False), False), (trainer(2, False), True)):
        refuse_fetched_media(t, vlm)
