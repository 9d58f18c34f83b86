"""seqpar.trl.SequenceParallelDPOTrainer with image prompts on a tiny Qwen2.5-VL vs the STOCK trl.DPOTrainer.

TRL's vision DPO path: a processor as processing_class (built offline as in tests/test_trl_grpo_vlm.py), rows with
"prompt" / "chosen" / "rejected" conversations and an "images" column (one or two PIL images, or none: images on
some pairs only). The stock trainer runs in the test process (one process, no SP: its DataCollatorForVisionPreference
and the model's own image path, each image encoded for the chosen and again for the rejected row); the seqpar class
in a spawned gloo world (the same collator renders each micro-batch, then SP with every image encoded once per SP
group). The same tiny model (saved, loaded by path), seed and sampler order (sequential); SGD lr 0.5, B = 2 pairs,
2 steps, reference model = a frozen copy. Compared: the logged losses and every final parameter (vision tower
included) at fp32 1e-5 absolute; the tower must have moved.
fast: Ulysses 2, sigmoid. slow: ring 2 IPO; USP 2x2 sigmoid with gradient accumulation 2; Qwen3-VL at ring 2 under
FSDP2 (fsdp_version 2: the policy's decoder layers and vision blocks sharded, parameters gathered to compare).
"""

from __future__ import annotations

import pytest
import torch

from seqpar.spawn import run_distributed

TOL = 1e-5


def _dataset():
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    words = "the cat sat on a mat while dogs ran far".split()
    sizes = [(16, 24), (16, 16), (24, 16), (16, 32)]
    rows = []
    for i in range(8):
        n_img = [1, 2, 0, 1][i % 4]
        imgs = [Image.fromarray((rng.random((*sizes[(i + k) % 4], 3)) * 255).astype("uint8")) for k in range(n_img)]
        say = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
        rows.append({"prompt": [{"role": "user", "content": say(2 + i % 3)}],
                     "chosen": [{"role": "assistant", "content": say(2 + i % 4)}],
                     "rejected": [{"role": "assistant", "content": say(1 + (i * 3) % 5)}], "images": imgs})
    return datasets.Dataset.from_list(rows)


def _train(case: dict, model_dir: str, out: str, sp: dict | None):
    import copy

    import trl
    from test_trl_grpo_vlm import _processor
    from test_trl_sft_vlm import _full_params
    from transformers import AutoModelForImageTextToText

    import seqpar.trl as strl

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    ref = copy.deepcopy(model)  # stock TRL would reload it by name: the same weights
    args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=2,
                         gradient_accumulation_steps=case.get("accum", 1), max_steps=2, logging_steps=1,
                         report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=False,
                         optim="sgd", learning_rate=0.5, max_grad_norm=0.0, beta=0.5,
                         loss_type=[case.get("loss", "sigmoid")], max_length=256, gradient_checkpointing=False,
                         train_sampling_strategy="sequential",
                         **({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if sp and case.get("fsdp2")
                            else {}))
    cls = trl.DPOTrainer if sp is None else strl.SequenceParallelDPOTrainer
    trainer = cls(model=model, ref_model=ref, args=args, train_dataset=_dataset(), processing_class=_processor(),
                  **(sp or {}))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    sharded = sum(type(m).__name__.startswith("FSDP") for m in trainer.model_wrapped.modules())
    assert bool(sharded) == bool(sp and case.get("fsdp2")), sharded  # FSDP2 took the policy's units
    return losses, _full_params(trainer.model)


def _sp_world(case: dict, model_dir: str, refs: str, out: str) -> dict:
    losses, params = _train(case, model_dir, out, case["sp"])
    ref_losses, ref_params, init = torch.load(refs)
    return {"losses": losses, "ref_losses": ref_losses,
            "dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "dparam": max(float((params[k] - v).abs().max()) for k, v in ref_params.items()),
            "vision_moved": max(float((params[k] - v).abs().max()) for k, v in init.items() if "visual" in k)}


def _run(case: dict, world: int, tmp_path) -> None:
    from transformers import AutoModelForImageTextToText

    from seqpar.hf import tiny_model

    model_dir = str(tmp_path / "tiny")
    tiny_model(case.get("arch", "qwen2_5_vl"), 4, 2, vocab_size=49152, seed=0).save_pretrained(model_dir)
    init = {k: v.detach() for k, v in
            AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).named_parameters()}
    losses, params = _train(case, model_dir, str(tmp_path / "ref"), None)
    torch.save([losses, params, init], tmp_path / "refs.pt")
    r = run_distributed(_sp_world, world, case, model_dir, str(tmp_path / "refs.pt"), str(tmp_path / "sp"),
                        timeout=600)[0]
    print(r)
    assert len(r["losses"]) == len(r["ref_losses"]) == 2, r
    assert r["dloss"] <= TOL and r["dparam"] <= TOL, r
    assert r["vision_moved"] > 1e-4, r  # the images reached the loss: the tower trained


def test_trl_dpo_images_sp2_match_stock_trl(tmp_path):
    _run({"sp": {"sequence_parallel_size": 2}}, 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case,world", [
    ({"sp": {"sequence_parallel_size": 2, "ring_degree": 2}, "loss": "ipo"}, 2),
    ({"sp": {"sequence_parallel_size": 4, "ulysses_degree": 2, "ring_degree": 2}, "accum": 2}, 4),
    ({"sp": {"sequence_parallel_size": 2, "ring_degree": 2}, "arch": "qwen3_vl", "fsdp2": True}, 2)],
    ids=["ring2-ipo", "usp2x2-accum2", "qwen3vl-ring2-fsdp2"])
def test_trl_dpo_images_slow_match_stock_trl(tmp_path, case, world):
    _run(case, world, tmp_path)


def test_trl_dpo_video_column_refused():
    import datasets
    import trl

    import seqpar.trl as strl
    from seqpar.errors import SeqParError
    from seqpar.hf import tiny_model

    ds = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c", "videos": ["clip"]}])
    args = trl.DPOConfig(output_dir="/tmp/x", report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(SeqParError, match="seqpar train"):
        strl.SequenceParallelDPOTrainer(model=tiny_model("qwen2_5_vl", 4, 2, vocab_size=49152, seed=0), args=args,
                                        train_dataset=ds, sequence_parallel_size=1)
