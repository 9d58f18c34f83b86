"""`stage: dpo` with image / video prompts on a tiny Qwen VL model, through `seqpar.train.run.train`, vs an
independent single-process reference.

Pairs carry `images` (one or two local PNGs, or none) / `videos` (a frame folder) with `<image>` / `<video>`
placeholders in the prompt; under SP each chosen and each rejected row gets its prompt's media
(seqpar.data.VisionDPOCollator: every prompt medium encoded once per SP group, its gradient summed over both rows).
The reference is plain PyTorch on the unmodified HF model: the pairs in the data stream's order, each prompt +
response on its own through the model's own image path and multimodal RoPE, summed response log-probs for the
policy and for a frozen copy (the reference model), the DPO / IPO / SimPO loss written out here, mean over the
step's pairs, SGD. Tolerance: every step's loss and every parameter (vision tower included) within 1e-5 absolute
(fp32) after the steps, and the tower must have moved (the images reached the loss).
The data puts an image across the Ulysses shard seam (asserted), images on some pairs only, B = 2 pairs.
fast: Qwen2.5-VL, Ulysses 2, sigmoid, two steps of one micro-batch; each prompt medium encoded once (in process).
slow (two micro-batches per step): Qwen3-VL ring 2 IPO; USP 2x2 SimPO; dp 2 x SP 2 with fsdp: true (the reference
model sharded too); LoRA at ring 2 (the reference: the adapter disabled); precomputed reference log-probs; the HF
Trainer DPO drop-in (seqpar.hf.SequenceParallelDPOTrainer) on the same pair rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from vlm_cases import sgd_step, write_images

from seqpar.spawn import run_distributed

TOL = 1e-5
PAIRS = [{"prompt": "<image> alpha", "chosen": "beta gamma", "rejected": "delta", "images": ["i0.png"]},
         {"prompt": "gamma <image> and <image>", "chosen": "mu", "rejected": "nu xi omicron",
          "images": ["i1.png", "i2.png"]},
         {"prompt": "delta epsilon", "chosen": "zeta", "rejected": "eta theta"},
         {"prompt": "ok <image> eta", "chosen": "tau upsilon", "rejected": "phi", "images": ["i3.png"]},
         {"prompt": "see <video> iota", "chosen": "kappa", "rejected": "lambda mu", "videos": ["clip"]},
         {"prompt": "x <image> y", "chosen": "chi psi", "rejected": "omega", "images": ["i2.png"]}]
SIZES = [(16, 24), (16, 16), (24, 16), (16, 16)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from PIL import Image

    d = tmp_path_factory.mktemp("dpo_vlm")
    rng = write_images(d, SIZES)
    (d / "clip").mkdir()
    for k in range(2):
        Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(d / "clip" / f"{k:03d}.png")
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return d / "pairs.jsonl"


def _cfg(data: Path, out: Path, arch: str, sp: dict, **over) -> dict:
    cfg = {"model": {"name": f"tiny:{arch}", "kwargs": {"num_heads": 4, "num_kv_heads": 2}},
           "dataset": {"path": str(data), "max_length": 96}, "stage": "dpo", "sequence_parallel": sp,
           "micro_batch_size": 2, "grad_accum": 2, "max_steps": 2, "seed": 3, "output_dir": str(out),
           "optimizer": {"name": "sgd", "lr": 0.5}, "checkpoint": {"save_final": True}, "progress": False,
           "export": {"final": False}, "memory": {"measure": False},
           "dpo": {"beta": 0.5, "loss_type": "sigmoid"}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def _train_world(cfg_dict: dict) -> dict:
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    res = train(config_from_dict(cfg_dict))
    return {"losses": res.losses, "state": res.final_state_path}


def _logp(model, ex: dict, side: str, max_length: int) -> tuple[torch.Tensor, int]:
    """Summed log-probs of the response (cut as the collator cuts prompt + response) and its token count."""
    prompt = ex["prompt_input_ids"]
    comp = ex[f"{side}_input_ids"][:max_length - len(prompt)]
    ids = torch.tensor([prompt + comp])
    cfg = model.config
    kw = {k: torch.as_tensor(ex[k]) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                               "video_grid_thw", "second_per_grid_ts") if k in ex}
    types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    logits = model(input_ids=ids, mm_token_type_ids=types, **kw).logits[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(comp)[:, None])
    return lp.sum(), len(comp)


def _pair_loss(d, pc, pr, rc, rr, nc, nr) -> torch.Tensor:
    if d.loss_type == "simpo":
        return -F.logsigmoid(d.beta * (pc / nc - pr / nr) - d.gamma)
    if d.loss_type == "ipo":
        return ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * d.beta)) ** 2
    return -F.logsigmoid(d.beta * ((pc - rc) - (pr - rr)))


def _reference(cfg_dict: dict, dp: int) -> tuple[list[float], dict, dict, list]:
    """(loss per step, parameters after the last step, initial parameters, the micro-batches) of the reference."""
    import contextlib
    import copy

    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.dataset.streams import DataStream
    from seqpar.train.model.load import apply_lora, load_model

    cfg = config_from_dict(cfg_dict)
    examples, _ = prepare_examples(cfg)  # tokenization + media: checked below, not the SP path under test
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    ref = copy.deepcopy(model).eval()
    if cfg.finetuning.method == "lora":  # the reference is the policy with its adapter disabled
        torch.manual_seed(cfg.seed)
        model, ref = apply_lora(model, cfg), None
    init = {k: p.detach().clone() for k, p in model.named_parameters()}
    streams = [DataStream(len(examples), dp, d, shuffle=cfg.dataset.shuffle, seed=cfg.seed) for d in range(dp)]
    losses, batches = [], []
    for _ in range(cfg.max_steps):
        batches += [[examples[i] for i in s.take(cfg.micro_batch_size)] for s in streams for _ in range(cfg.grad_accum)]
        pairs = [ex for b in batches[-dp * cfg.grad_accum:] for ex in b]
        total = 0.0
        for ex in pairs:
            (pc, nc), (pr, nr) = (_logp(model, ex, s, cfg.dataset.max_length) for s in ("chosen", "rejected"))
            frozen = model if ref is None else ref
            with torch.no_grad(), (model.disable_adapter() if ref is None else contextlib.nullcontext()):
                rc, rr = (_logp(frozen, ex, s, cfg.dataset.max_length)[0] for s in ("chosen", "rejected"))
            if "ref_chosen_logps" in ex:  # precomputed: the reference model's values must be what the rows carry
                assert abs(ex["ref_chosen_logps"] - float(rc)) < 1e-9
                assert abs(ex["ref_rejected_logps"] - float(rr)) < 1e-9
            total = total + _pair_loss(cfg.dpo, pc, pr, rc, rr, nc, nr)
        loss = total / len(pairs)
        sgd_step(model, loss, cfg.optimizer.lr)
        losses.append(float(loss.detach()))
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}, init, batches


def _seam_crossed(batches: list, arch: str) -> bool:
    """Some row of a micro-batch (Ulysses 2: the seam at half the padded length) has an image / video run across
    the seam."""
    from seqpar.hf import tiny_config
    from seqpar.train.model.tokenizers import ByteTokenizer

    c = tiny_config(arch, vocab_size=ByteTokenizer.vocab_size)
    media = {c.image_token_id, c.video_token_id}
    for batch in batches:
        rows = [ex["prompt_input_ids"] + ex[f"{s}_input_ids"] for ex in batch for s in ("chosen", "rejected")]
        seam = -(-max(len(r) for r in rows) // 2)
        if any(r[seam - 1] in media and r[seam] in media for r in rows if len(r) > seam):
            return True
    return False


def _compare(res, cfg, dp):
    ref_losses, ref_params, init, batches = _reference(cfg, dp)
    state = torch.load(res[0]["state"])  # LoRA: the adapter's weights only
    assert max(abs(a - b) for a, b in zip(res[0]["losses"], ref_losses)) <= TOL, (res[0]["losses"], ref_losses)
    assert set(state) <= set(ref_params) and (len(state) == len(ref_params) or all("lora_" in k for k in state))
    worst = max(float((v.float() - ref_params[k]).abs().max()) for k, v in state.items())
    # the tower trained (the images reached the loss); LoRA on the decoder's attention: its adapters moved
    moved = max(float((v.float() - init[k]).abs().max()) for k, v in state.items() if "visual" in k or "lora_" in k)
    print(f"dloss {max(abs(a - b) for a, b in zip(res[0]['losses'], ref_losses)):.3g} dparam {worst:.3g} "
          f"moved {moved:.3g}")
    assert worst <= TOL, worst
    assert moved > 1e-4, moved
    return batches


def test_dpo_image_prompts_ulysses2(data, tmp_path):
    # seed 4, one micro-batch per step: [pairs 4, 5] (a video, an image across the seam), then [1, 2] (text only)
    cfg = _cfg(data, tmp_path / "run", "qwen2_5_vl", {"size": 2, "ulysses_degree": 2}, seed=4, grad_accum=1)
    batches = _compare(run_distributed(_train_world, 2, cfg, timeout=600), cfg, dp=1)
    assert _seam_crossed(batches, "qwen2_5_vl")
    media = [("pixel_values" in e, "pixel_values_videos" in e) for b in batches for e in b]
    assert any(i for i, _ in media) and any(v for _, v in media) and not all(i or v for i, v in media), media


@pytest.mark.slow
@pytest.mark.parametrize("arch,sp,loss,world,extra", [
    ("qwen3_vl", {"size": 2, "ring_degree": 2}, "ipo", 2, {}),
    ("qwen2_5_vl", {"size": 4, "ulysses_degree": 2, "ring_degree": 2}, "simpo", 4, {}),
    ("qwen2_5_vl", {"size": 2, "ulysses_degree": 2}, "sigmoid", 4, {"fsdp": True}),
    ("qwen2_5_vl", {"size": 2, "ring_degree": 2}, "sigmoid", 2, {"finetuning": {"method": "lora", "r": 4}}),
])
def test_dpo_image_prompts_slow(data, tmp_path, arch, sp, loss, world, extra):
    cfg = _cfg(data, tmp_path / "run", arch, sp, dpo={"loss_type": loss}, **extra)
    _compare(run_distributed(_train_world, world, cfg, timeout=900), cfg, dp=world // sp["size"])


@pytest.mark.slow
def test_dpo_image_prompts_precomputed_ref(data, tmp_path):
    """Rows carrying the reference model's log-probs (computed here with the model's own image path): the
    same training as with the reference model."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_model

    cfg = _cfg(data, tmp_path / "run", "qwen2_5_vl", {"size": 2, "ulysses_degree": 2})
    c = config_from_dict(cfg)
    examples, _ = prepare_examples(c)
    torch.manual_seed(c.seed)
    model = load_model(c).eval()
    rows = []
    with torch.no_grad():
        for row, ex in zip(PAIRS, examples):
            lc, lr = (float(_logp(model, ex, s, c.dataset.max_length)[0]) for s in ("chosen", "rejected"))
            rows.append({**row, "ref_chosen_logps": lc, "ref_rejected_logps": lr})
    path = data.parent / "pairs_ref.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg["dataset"]["path"] = str(path)
    _compare(run_distributed(_train_world, 2, cfg, timeout=600), cfg, dp=1)


def _hf_world(cfg_dict: dict, out: str) -> dict:
    """seqpar.hf.SequenceParallelDPOTrainer on the examples `seqpar train` would build (rows with their prompt's
    media: VisionDPOCollator), the same seeded model, sequential order, constant lr SGD."""
    from transformers import TrainingArguments

    from seqpar.hf import SequenceParallelDPOTrainer
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(cfg_dict)
    examples, _ = prepare_examples(cfg)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=cfg.micro_batch_size,
                             gradient_accumulation_steps=cfg.grad_accum, max_steps=cfg.max_steps, logging_steps=1,
                             report_to=[], save_strategy="no", train_sampling_strategy="sequential", use_cpu=True,
                             seed=cfg.seed, disable_tqdm=True, optim="sgd", learning_rate=cfg.optimizer.lr,
                             lr_scheduler_type="constant", max_grad_norm=0.0, remove_unused_columns=False)
    trainer = SequenceParallelDPOTrainer(model=model, args=args, train_dataset=examples, beta=cfg.dpo.beta,
                                         loss_type=cfg.dpo.loss_type, sequence_parallel_size=cfg.sequence_parallel.size)
    trainer.train()
    state = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    path = f"{out}/state.pt"
    if torch.distributed.get_rank() == 0:
        torch.save(state, path)
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "state": path}


@pytest.mark.slow
def test_hf_dpo_trainer_image_prompts(data, tmp_path):
    """The HF Trainer DPO drop-in with VL pair rows (prompt media as the processor's keys), SP=2 Ulysses."""
    # one micro-batch per step: the Trainer closes an accumulation at the end of an epoch (3 micro-batches here)
    cfg = _cfg(data, tmp_path / "run", "qwen2_5_vl", {"size": 2, "ulysses_degree": 2}, dataset={"shuffle": False},
               grad_accum=1)
    _compare(run_distributed(_hf_world, 2, cfg, str(tmp_path), timeout=600), cfg, dp=1)


def test_dpo_media_in_a_response_refused(data):
    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples

    rows = [dict(PAIRS[0], chosen="here <image>")]
    path = data.parent / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_from_dict(_cfg(path, Path("/tmp/x"), "qwen2_5_vl", {"size": 1}))
    with pytest.raises(SeqParError, match="put every image / video in the prompt"):
        prepare_examples(cfg)
    cfg = config_from_dict(_cfg(data, Path("/tmp/x"), "qwen2_5_vl", {"size": 1}, dataset={"max_prompt_length": 8}))
    with pytest.raises(SeqParError, match="an image or video cannot be cut"):
        prepare_examples(cfg)


def test_each_prompt_medium_encoded_once(data):
    """In process (SP size 1): VisionDPOCollator gives the rejected rows their chosen rows' media, which the tower
    encodes once (patches counted); the logits equal those of the same batch with every medium encoded (same_as
    dropped); a same_as that names a different medium is refused."""
    import seqpar
    from seqpar.data import VisionDPOCollator
    from seqpar.errors import SeqParError
    from seqpar.hf import apply_sequence_parallel
    from seqpar.hf.vision import vision_batch_inputs
    from seqpar.hf.vision_encode import VISION_KWARG
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(_cfg(data, Path("/tmp/x"), "qwen2_5_vl", {"size": 1}))
    examples, _ = prepare_examples(cfg)
    mesh = seqpar.init_mesh(1)
    model = apply_sequence_parallel(load_model(cfg), mesh).eval()
    batch = VisionDPOCollator(mesh, 258)([examples[1], examples[2], examples[4]])  # 2 images, none, a video
    assert batch["media_same_as"].tolist() == [0, 1, 0, 1, 4, 4]
    once = vision_batch_inputs(model, batch, None)
    twice = vision_batch_inputs(model, {k: v for k, v in batch.items() if k != "media_same_as"}, None)
    with torch.no_grad():
        a, b = model(**once).logits, model(**twice).logits
    chosen = int(examples[1]["image_grid_thw"].prod(-1).sum() + examples[4]["video_grid_thw"].prod(-1).sum())
    assert once[VISION_KWARG].encoded_patches == chosen and twice[VISION_KWARG].encoded_patches == 2 * chosen
    assert torch.equal(a, b)
    for bad in ([0, 1, 1, 1, 4, 4], [0, 1, 0, 1, 4], [0, 1, 0, 0, 4, 4]):  # grid differs / count / images crossed
        with pytest.raises(SeqParError, match="same_as"):
            vision_batch_inputs(model, {**batch, "media_same_as": torch.tensor(bad)}, None)
