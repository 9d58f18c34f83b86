"""seqpar.trl.SequenceParallelSFTTrainer on image datasets (tiny Qwen2.5-VL / Qwen3-VL) vs the STOCK trl.SFTTrainer.

As tests/test_trl.py: the stock trainer on one process (no SP) in the test process, the seqpar class in a spawned
2-rank gloo world (SP = 2), the same tiny model (saved, loaded by path), rows, seed and sequential order. The
processor is built offline (tests/test_trl_grpo_vlm.py: Qwen's PIL image processor with 4-pixel patches, SmolLM2's
tokenizer with Qwen's vision tokens, a small chat template; here also a variant with generation markers). Rows:
TRL's "images" column (PIL images) with image content blocks, images on some rows only, two images in one row, of
several sizes; formats: messages, conversational prompt / completion (completion_only_loss), multi-turn messages
with assistant_only_loss, and a text-only dataset on the VL model. TRL's own vision collator builds each batch on
both sides; the seqpar run must find an image whose tokens cross a shard seam. SGD lr 0.1, TRL's clipping
(max_grad_norm 1.0), batch 2, grad-accum 2, 2 steps: every step's gradient norm (float64, 1e-5 relative; the logged
fp32 norms 1e-4), every logged loss
and every final parameter (vision tower included, which must have moved) at fp32 1e-5 absolute; one case also
the eval loss after training (every eval row in one batch). Grad accumulation: the VL model classes declare
accepts_loss_kwargs=False, so the stock Trainer would average the micro-batches' own token means; the reference
turns its token-count normalisation on (model_accepts_loss_kwargs), the global token mean seqpar computes.
Fast: Qwen2.5-VL, messages, Ulysses, DDP. Slow: Qwen3-VL / ring / FSDP2 (fsdp_version 2, every vision block a unit) /
assistant_only_loss with gradient checkpointing / text rows / dp 2 x SP 2 under FSDP2 over the 4 ranks (the stock
batch holds both dp ranks' rows; seqpar's sampler strides them over dp).
"""

from __future__ import annotations

import pytest
import torch
from test_trl_grpo_vlm import _processor

from seqpar.spawn import run_distributed

TOL = 1e-5
WORDS = "the cat sat on a mat while dogs ran far and birds sang songs of long summer days".split()
# TEMPLATE with {% generation %} markers around each assistant turn (assistant_only_loss)
GEN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}<|im_end|>{% endgeneration %}\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|>"
    "<|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SIZES = [(16, 24), (32, 32), (24, 16), (8, 32), (16, 32)]
IMAGES = [1, 0, 2, 1, 0, 2, 1, 0]  # per row: images on some rows only, two in some


def _text(rng, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))


def _dataset(fmt: str):
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = []
    for i, n in enumerate(IMAGES):
        images = [Image.fromarray((rng.random((*SIZES[(i + k) % 5], 3)) * 255).astype("uint8")) for k in range(n)]
        user = [{"type": "text", "text": _text(rng, 2, 10)}, *[{"type": "image", "text": None}] * n,
                {"type": "text", "text": _text(rng, 1, 6)}]
        answer = [{"type": "text", "text": _text(rng, 2, 16)}]
        if fmt == "messages":
            rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                         "images": images})
        elif fmt == "prompt_completion":  # completion_only_loss (TRL's default for this format)
            rows.append({"prompt": [{"role": "user", "content": user}],
                         "completion": [{"role": "assistant", "content": answer}], "images": images})
        elif fmt == "assistant_only":  # two turns: every user token unsupervised
            more = [{"type": "text", "text": _text(rng, 2, 8)}]
            rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer},
                                      {"role": "user", "content": more}, {"role": "assistant", "content": more}],
                         "images": images})
        else:  # text rows on the VL model: TRL prepares them as for a text model
            rows.append({"prompt": _text(rng, 3, 14), "completion": " " + _text(rng, 2, 16)})
    return datasets.Dataset.from_list(rows)


def _full_params(model) -> dict[str, torch.Tensor]:
    return {k.replace("module.", ""): (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()}


def _record_exact_norms(trainer) -> list[float]:
    """The float64 norm of the whole gradient (gathered from FSDP2's shards) at each clipping. The norms the Trainer
    LOGS are fp32: torch's fp32 vector_norm on CPU is off by up to ~2e-4 on the 49152-row lm_head gradient, and
    differently for FSDP2's half-size shards, so those agree only to 1e-4 (tests/test_trainer_stacks_trl.py)."""
    exact, clip = [], trainer.accelerator.clip_grad_norm_

    def recording(parameters, *a, **k):
        parameters = list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        exact.append(sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5)
        return clip(parameters, *a, **k)

    trainer.accelerator.clip_grad_norm_ = recording
    return exact


def _seam_crossings(trainer, ds) -> int:
    """Image-token runs of the training batches that this rank's shard holds only part of."""
    from seqpar import shard

    mesh, image = trainer.sp_mesh, trainer.model.config.image_token_id
    crossings = 0
    for start in range(0, len(ds), 2):
        ids = trainer.data_collator.collate_full([ds[i] for i in range(start, min(start + 2, len(ds)))])["input_ids"]
        local = torch.zeros_like(ids, dtype=torch.bool)
        local[:, shard(torch.arange(ids.shape[1])[None], mesh, 1)[0]] = True
        for row, here in zip((ids == image).tolist(), local.tolist()):
            runs, cur = [], []
            for j, is_img in enumerate(row + [False]):
                if is_img:
                    cur.append(here[j])
                elif cur:
                    runs.append(cur)
                    cur = []
            crossings += sum(any(r) and not all(r) for r in runs)
    return crossings


def _train(case: dict, model_dir: str, out: str, sp: bool):
    import trl
    from transformers import AutoModelForImageTextToText

    import seqpar.trl as strl

    fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if sp and case.get("fsdp2") else {}
    batch = 2 * case.get("dp", 1) if not sp else 2  # dp: the stock batch holds the rows of every dp rank
    args = trl.SFTConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=2, max_steps=2,
                         logging_steps=1, report_to=[], save_strategy="no", train_sampling_strategy="sequential",
                         use_cpu=True, seed=0, disable_tqdm=True, bf16=False, optim="sgd", learning_rate=0.1,
                         max_grad_norm=1.0, gradient_checkpointing=case.get("checkpointing", False),
                         assistant_only_loss=case["fmt"] == "assistant_only", per_device_eval_batch_size=8, **fsdp)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    proc = _processor()
    if case["fmt"] == "assistant_only":
        proc.chat_template = proc.tokenizer.chat_template = GEN_TEMPLATE
    ds = _dataset(case["fmt"])
    if sp:
        trainer = strl.SequenceParallelSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=proc,
                                                  sequence_parallel_size=2, ring_degree=case.get("ring"))
    else:
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=proc)
        # The VL model classes declare accepts_loss_kwargs=False, so the stock Trainer would average the
        # micro-batches' own token means; with this it normalises by the step's token count, as for text models
        # (and as seqpar does): the reference then checks seqpar's global token-mean over grad-accum steps.
        assert not trainer.model_accepts_loss_kwargs
        trainer.model_accepts_loss_kwargs = True
    crossings = _seam_crossings(trainer, ds) if sp and case["fmt"] != "text" else 0
    init = _full_params(trainer.model)
    exact = _record_exact_norms(trainer)
    trainer.train()
    log = trainer.state.log_history
    # one eval batch of every row: stock TRL's eval loss (a mean of per-batch means) is then the token mean too
    evaluated = trainer.evaluate(_dataset(case["fmt"]))["eval_loss"] if case.get("eval") else 0.0
    return {"losses": [h["loss"] for h in log if "loss" in h], "gnorms": [h["grad_norm"] for h in log
                                                                         if "grad_norm" in h],
            "exact_norms": exact, "params": _full_params(trainer.model), "init": init, "crossings": crossings,
            "eval_loss": evaluated,
            "vision_units": sum(type(m).__name__.startswith("FSDP") and type(m).__name__.endswith("VisionBlock")
                                for m in trainer.model_wrapped.modules())}


def _sp_world(case: dict, model_dir: str, refs: str, out: str) -> dict:
    ref = torch.load(refs)
    got = _train(case, model_dir, out, sp=True)
    p, q = got["params"], ref["params"]
    assert p.keys() == q.keys(), (sorted(p)[:4], sorted(q)[:4])
    return {"losses": got["losses"], "ref_losses": ref["losses"], "crossings": got["crossings"],
            "gnorms": got["gnorms"], "ref_gnorms": ref["gnorms"],
            "dgnorm_logged": max(abs(a - b) / b for a, b in zip(got["gnorms"], ref["gnorms"])),
            "dgnorm": max(abs(a - b) / b for a, b in zip(got["exact_norms"], ref["exact_norms"])),
            "vision_units": got["vision_units"], "deval": abs(got["eval_loss"] - ref["eval_loss"]),
            "dloss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])),
            "dparam": max(float((p[k] - v).abs().max()) for k, v in q.items()),
            "moved": max(float((v - ref["init"][k]).abs().max()) for k, v in q.items()),
            "vision_moved": max(float((v - ref["init"][k]).abs().max()) for k, v in q.items() if "visual" in k)}


def _run(tmp_path, case: dict) -> dict:
    from seqpar.hf import tiny_model

    model_dir = str(tmp_path / "tiny")
    tiny_model(case["arch"], 4, 2, vocab_size=49152, seed=0).save_pretrained(model_dir)
    ref = _train(case, model_dir, str(tmp_path / "ref"), sp=False)
    torch.save(ref, tmp_path / "ref.pt")
    r = run_distributed(_sp_world, 2 * case.get("dp", 1), case, model_dir, str(tmp_path / "ref.pt"),
                        str(tmp_path / "sp"), timeout=600)[0]
    print(case, r)
    assert len(r["losses"]) == len(r["ref_losses"]) == 2, r
    assert r["dgnorm"] <= TOL and r["dloss"] <= TOL and r["dparam"] <= TOL and r["deval"] <= TOL, r
    assert r["dgnorm_logged"] <= 1e-4, r  # fp32 norms: see _record_exact_norms
    assert r["moved"] > 1e-3, r
    if case["fmt"] != "text":
        assert r["vision_moved"] > 1e-4, r  # the images reached the loss: the tower trained
        assert r["crossings"] > 0, r  # an image's tokens cross a shard seam
    if case.get("fsdp2"):
        assert r["vision_units"] == 2, r  # every vision block is its own FSDP2 unit (every rank runs the tower)
    return r


def test_trl_sft_images_sp2_ddp_matches_stock_trl(tmp_path):
    _run(tmp_path, {"arch": "qwen2_5_vl", "fmt": "messages"})


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    {"arch": "qwen3_vl", "fmt": "prompt_completion", "ring": 2, "fsdp2": True},
    {"arch": "qwen2_5_vl", "fmt": "assistant_only", "fsdp2": True, "checkpointing": True},
    {"arch": "qwen3_vl", "fmt": "messages", "ring": 2, "eval": True},
    {"arch": "qwen2_5_vl", "fmt": "text", "ring": 2},
    {"arch": "qwen2_5_vl", "fmt": "messages", "dp": 2, "fsdp2": True},
], ids=["qwen3-completion-ring-fsdp2", "qwen25-assistant-fsdp2-ckpt", "qwen3-messages-ring", "qwen25-text-rows",
        "qwen25-dp2-sp2-fsdp2"])
def test_trl_sft_images_slow_cases_match_stock_trl(tmp_path, case):
    _run(tmp_path, case)


# ----------------------------------------------------------------------------- refusals (no process group)
@pytest.mark.parametrize("what,kw,expect", [
    ("video column", {}, "trains on images only"),
    ("packing", {"packing": True}, "set packing=False"),
    ("padding_free", {"padding_free": True}, "set padding_free=False"),
])
def test_trl_sft_vision_refusals_say_what_to_change(tmp_path, what, kw, expect):
    import datasets
    import trl

    import seqpar.trl as strl
    from seqpar.errors import SeqParError
    from seqpar.hf import tiny_model

    ds = _dataset("messages")
    if what == "video column":
        ds = datasets.Dataset.from_list([{"messages": r["messages"], "videos": ["clip.mp4"]} for r in ds])
    args = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **kw)
    with pytest.raises(SeqParError, match=expect) as e:
        strl.SequenceParallelSFTTrainer(model=tiny_model("qwen2_5_vl", 4, 2, vocab_size=49152), args=args,
                                        train_dataset=ds, processing_class=_processor(), sequence_parallel_size=1)
    assert "not supported under sequence parallelism" in str(e.value), e.value
