"""`stage: grpo` with image prompts on a tiny Qwen VL model, through `seqpar.train.run.train`, vs an independent
single-process reference.

Prompts carry `images` (one or two local PNGs, or none) with `<image>` placeholders; rollouts see the images
(generate() gets the prompts' pixel values) and the policy's loss runs on the full multimodal sequence under SP.
The reference is plain PyTorch on the unmodified HF model: the same prompts (the data stream's order),
completions drawn by seqpar.hf.generation.generate_for_group on the UNPATCHED model with the prompts' media as
one SP=1 process (the same seeds), rewards and advantages written out here, and the "grpo" loss by hand on each
prompt + completion row with its images (the model's own image path and multimodal RoPE): mean over the step's
sequences of the per-sequence mean of -A * exp(logp - logp.detach()) + beta * k3(ref, logp); SGD steps.
Tolerance: loss and every parameter (vision tower included) within 1e-5 absolute (fp32) after the steps.
fast: Qwen2.5-VL, Ulysses 2, beta 0.04, two steps (the second samples from the updated policy: KL > 0); Qwen3-VL,
ring 2, beta 0, one step. slow: dp 2 x SP 2 with fsdp: true (the tower in the root unit for rollouts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vlm_cases import sgd_step, write_images

from seqpar.spawn import run_distributed

TOL = 1e-5
EOS = 257
PROMPTS = [{"prompt": "look <image> alpha", "answer": "a", "images": ["i0.png"]},
           {"prompt": "gamma <image> and <image>", "answer": "m", "images": ["i1.png", "i2.png"]},
           {"prompt": "delta epsilon", "answer": "z"},
           {"prompt": "<image> eta", "answer": "t", "images": ["i3.png"]}]
SIZES = [(16, 24), (16, 16), (24, 16), (16, 16)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:

    d = tmp_path_factory.mktemp("grpo_vlm")
    write_images(d, SIZES)
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (d / "vlm_reward.py").write_text(REWARD)
    return d / "prompts.jsonl"


# A reward with spread on a random tiny policy (its completions rarely end or match within a few tokens).
REWARD = """
def first_id(prompts, completions, completion_ids, **kwargs):
    return [float(c[0] % 7) for c in completion_ids]
"""


def _cfg(data: Path, out: Path, arch: str, sp: dict, **over) -> dict:
    cfg = {"model": {"name": f"tiny:{arch}", "kwargs": {"num_heads": 4, "num_kv_heads": 2}},
           "dataset": {"path": str(data), "max_length": 96}, "stage": "grpo", "sequence_parallel": sp,
           "micro_batch_size": 2, "grad_accum": 2, "max_steps": 1, "seed": 3, "output_dir": str(out),
           "optimizer": {"name": "sgd", "lr": 0.5}, "checkpoint": {"save_final": True}, "progress": False,
           "export": {"final": False}, "memory": {"measure": False},
           "grpo": {"reward_funcs": ["vlm_reward:first_id", "seqpar:length"], "reward_weights": [1.0, 0.5],
                    "num_generations": 2, "max_prompt_length": 64, "max_completion_length": 6,
                    "temperature": 0.7, "beta": 0.04}}
    for k, v in over.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
    return cfg


def _train_world(cfg_dict: dict) -> dict:
    import sys

    sys.path.insert(0, str(Path(cfg_dict["dataset"]["path"]).parent))  # the reward module
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    res = train(config_from_dict(cfg_dict))
    return {"losses": res.losses, "state": res.final_state_path}


def _reference(cfg_dict: dict, dp: int) -> tuple[list[float], dict, dict]:
    """(loss per step, parameters after the last step, initial parameters) of the reference."""
    import copy

    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prompts import load_prompts
    from seqpar.train.dataset.streams import DataStream
    from seqpar.train.model.load import load_model, load_tokenizer, model_info

    cfg = config_from_dict(cfg_dict)
    prompts, _ = load_prompts(cfg, load_tokenizer(cfg), model_info(cfg))  # tokenization + media: not under test
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    init = {k: p.detach().clone() for k, p in model.named_parameters()}
    ref = copy.deepcopy(model).eval()
    streams = [DataStream(len(prompts), dp, d, shuffle=True, seed=cfg.seed) for d in range(dp)]
    losses = [_reference_step(cfg, model, ref, streams, prompts, step) for step in range(cfg.max_steps)]
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}, init


def _logps(model, row, comp: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([row.prompt_ids + comp])
    cfg = model.config
    kw = {k: torch.as_tensor(v) for k, v in row.media.items() if k in ("pixel_values", "image_grid_thw")}
    types = (ids == cfg.image_token_id).int()
    logits = model(input_ids=ids, mm_token_type_ids=types, **kw).logits[0, len(row.prompt_ids) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(comp)[:, None])[:, 0]


def _reference_step(cfg, model, ref, streams, prompts, step: int) -> float:
    from types import SimpleNamespace

    from seqpar.hf.generation import generate_for_group

    g = cfg.grpo
    per_dp = cfg.micro_batch_size * cfg.grad_accum // g.num_generations
    rows = []
    for d, stream in enumerate(streams):
        picked = [prompts[i] for i in stream.take(per_dp)]
        mesh = SimpleNamespace(sp_size=1, sp_rank=0, dp_rank=d, dp_size=1, sp_group=None,
                               comm_device=torch.device("cpu"))
        comps = generate_for_group(model, mesh, [p.prompt_ids for p in picked], num_generations=g.num_generations,
                                   max_new_tokens=g.max_completion_length, temperature=g.temperature, seed=cfg.seed,
                                   step=step, eos_token_id=EOS, pad_token_id=258,
                                   prompt_index=[d + len(streams) * j for j in range(len(picked))],
                                   media=[p.media for p in picked])
        for j, p in enumerate(picked):
            mine = comps[j * g.num_generations:(j + 1) * g.num_generations]
            assert not any(t in (259, 260) for c in mine for t in c), "the sampler drew a media placeholder"
            r = torch.tensor([c[0] % 7 + 0.5 * len(c) / 100 for c in mine], dtype=torch.float64)
            adv = (r - r.mean()) / (r.std() + 1e-4)
            rows += [(p, c, float(a)) for c, a in zip(mine, adv)]
    model.train()
    total = 0.0
    for p, c, a in rows:
        lp = _logps(model, p, c, g.temperature)
        with torch.no_grad():
            rlp = _logps(ref, p, c, g.temperature)
        k3 = torch.exp(rlp - lp) - (rlp - lp) - 1
        total = total + (-a * torch.exp(lp - lp.detach()) + g.beta * k3).mean()
    loss = total / len(rows)
    sgd_step(model, loss, cfg.optimizer.lr)
    return float(loss.detach())


def _compare(res, cfg, dp):
    ref_losses, ref_params, init = _reference(cfg, dp)
    state = torch.load(res[0]["state"])
    assert max(abs(a - b) for a, b in zip(res[0]["losses"], ref_losses)) <= TOL, (res[0]["losses"], ref_losses)
    worst = max(float((state[k].float() - v).abs().max()) for k, v in ref_params.items())
    moved = max(float((state[k].float() - v).abs().max()) for k, v in init.items() if "visual" in k)
    assert worst <= TOL, worst
    assert moved > 1e-4, moved  # the vision tower trained: the images reached the loss


@pytest.mark.parametrize("arch,sp,beta,steps", [
    ("qwen2_5_vl", {"size": 2, "ulysses_degree": 2}, 0.04, 2),
    ("qwen3_vl", {"size": 2, "ring_degree": 2}, 0.0, 1)])
def test_grpo_image_prompts_sp2(data, tmp_path, arch, sp, beta, steps):
    cfg = _cfg(data, tmp_path / "run", arch, sp, max_steps=steps, grpo={"beta": beta})
    _compare(run_distributed(_train_world, 2, cfg, timeout=600), cfg, dp=1)


@pytest.mark.slow
def test_grpo_image_prompts_fsdp_dp2_sp2(data, tmp_path):
    cfg = _cfg(data, tmp_path / "run", "qwen2_5_vl", {"size": 2, "ulysses_degree": 2}, fsdp=True)
    _compare(run_distributed(_train_world, 4, cfg, timeout=900), cfg, dp=2)


def test_text_model_refuses_image_prompts(data):
    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples

    cfg = config_from_dict(_cfg(data, Path("/tmp/x"), "qwen2_5_vl", {"size": 1}, model={"name": "tiny:llama"}))
    with pytest.raises(SeqParError, match="the model is text-only"):
        prepare_examples(cfg)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_grpo_with_images_runs_at_default_sampling(data, tmp_path, arch, monkeypatch):
    """A GRPO step with image prompts on the shipped tiny VL models at grpo's default sampling (temperature 1, no
    top_k / top_p) and 32-token completions: it stopped in step 1 when the sampler could draw a media placeholder
    (shown here by letting it), and runs now (the sampler never draws one)."""
    import seqpar.hf.generation as generation
    from seqpar.errors import SeqParError

    cfg = _cfg(data, tmp_path / "run", arch, {"size": 1}, micro_batch_size=4, checkpoint={"save_final": False},
               grpo={"temperature": 1.0, "max_completion_length": 32, "num_generations": 4, "beta": 0.0})
    with monkeypatch.context() as m:
        m.setattr(generation, "placeholder_ids", lambda model: [])
        with pytest.raises(SeqParError, match="(image|video) tokens but (image|video)_grid_thw describes"):
            _train_world(dict(cfg, output_dir=str(tmp_path / "unmasked")))
    res = _train_world(cfg)
    assert len(res["losses"]) == 1 and res["losses"][0] == res["losses"][0]  # one finite step
