"""The TRL drop-in's `use_vllm=True` (seqpar.trl.grpo_vllm): seqpar's colocated vLLM engine, the one `seqpar train`
uses. Runs in the environment `make vllm-env` builds (with trl 1.16), like the rest of tests/vllm_env.

The same tiny Llama (head_dim 32, the CPU attention's smallest) and a word-level tokenizer are saved to a folder that
both trainers load; 4 prompts, 2 generations each, 2 steps of plain SGD (lr 0.5, constant, no clipping), fp32,
beta 0.04 (a frozen reference: the initial weights), TRL's use_bias_correction_kl off (seqpar train's default),
TRL's default vLLM importance sampling (correction on, sequence_mask, clip_max 3; seqpar train's
grpo.importance_correction: sequence_mask): the sampler agrees with the trainer, so the ratios are ~1 and the
correction's exactness is tests/test_grpo_iterations.py's.
- The drop-in at SP 2 on 2 ranks vs SP 1 on 1 rank: the same completions (each row has its own seed), per-step
  losses within 1e-5, every parameter after the two SGD steps within 1e-5; the engine's log-probs of the sampled
  tokens within 1e-4 of the trainer's exact SP log-probs (rollout_logprob_diff_max, logged).
- The drop-in at SP 1 vs `seqpar train` (stage grpo, grpo.rollout.engine vllm, importance_correction sequence_mask)
  on the same prompts in the same order (TRL's shuffle_dataset=False, seqpar's dataset.shuffle false): the same
  completions, per-step losses within 1e-5 and the same parameters within 1e-5 (the exported final model).
- Slow: DeepSpeed ZeRO-3 at SP 2 vs the plain SP 1 run (completions, losses, parameters; the partitions streamed
  into the engine); dp 2 x SP 1 draws the SP 1 run's completions and trains to its parameters; LoRA SP 2 vs SP 1 (the
  merged adapters are what the engine samples).
- Refusals (one line, before any collective): a head_dim the CPU attention does not run; ranks that are threads
  (seqpar.threaded). TRL's vLLM options refused or mapped: tests/test_trl_grpo.py (no vLLM needed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("trl")

from seqpar.errors import SeqParError  # noqa: E402
from seqpar.spawn import run_distributed  # noqa: E402
from seqpar.threaded import run_threaded  # noqa: E402

TOL = 1e-5
LP_TOL = 1e-4
HERE = Path(__file__).parent
PROMPTS = [{"prompt": "alpha beta", "answer": "a"}, {"prompt": "gamma", "answer": "m"},
           {"prompt": "delta epsilon zeta", "answer": "z"}, {"prompt": "eta", "answer": "t"}]
WORDS = sorted({w for r in PROMPTS for w in r["prompt"].split()})
VOCAB = 160  # the reward (vllm_rewards.low_ids) counts ids below 80


def _save_model(folder: Path, head_dim: int = 32) -> None:
    """A word-level tokenizer (no special tokens added to a prompt) and a tiny Llama whose eos is the tokenizer's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from seqpar.hf import tiny_model

    words = ["<pad>", "<eos>", "<unk>", *WORDS]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(VOCAB - len(words))])}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    model = tiny_model("llama", 4, 2, head_dim=head_dim, vocab_size=VOCAB, seed=0)
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.pad_token_id, c.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _grpo_config(out: str, **extra):
    from trl import GRPOConfig

    kw = dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=2,
              num_generations=2, max_completion_length=12, temperature=0.7, beta=0.04, use_bias_correction_kl=False,
              loss_type="grpo", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=9,
              disable_tqdm=True, bf16=False, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
              max_grad_norm=0.0, gradient_checkpointing=False, shuffle_dataset=False, use_vllm=True,
              vllm_mode="colocate", vllm_max_model_length=48)  # TRL's default importance sampling: sequence_mask
    return GRPOConfig(**{**kw, **extra})


def _dropin(model_dir: str, out: str, sp: int, lora: bool = False, **extra) -> dict:
    """One drop-in run in this (spawned) world: its completions, logged losses and mismatches, final parameters."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import seqpar.trl.grpo as grpo
    from seqpar.trl import SequenceParallelGRPOTrainer

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from vllm_rewards import low_ids

    drawn: list = []
    engine_lps: list = []
    real = grpo.vllm_completions

    def recorded(trainer, prompt_ids, num_generations):
        ids, lps = real(trainer, prompt_ids, num_generations)
        drawn.append([list(p) + [-1] + list(c) for p, c in zip(prompt_ids, ids)])
        engine_lps.append(lps)
        return ids, lps

    grpo.vllm_completions = recorded
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = SequenceParallelGRPOTrainer(
        model=model, reward_funcs=low_ids, args=_grpo_config(out, **extra),
        train_dataset=datasets.Dataset.from_list(PROMPTS), processing_class=AutoTokenizer.from_pretrained(model_dir),
        sequence_parallel_size=sp, peft_config=_lora() if lora else None)
    trainer.train()
    logs = trainer.state.log_history
    return {"drawn": drawn, "engine_lps": engine_lps, "losses": [h["loss"] for h in logs if "loss" in h],
            "zero3": any(hasattr(p, "ds_id") for p in trainer.model.parameters()),
            "diff_max": [h["rollout_logprob_diff_max"] for h in logs if "rollout_logprob_diff_max" in h],
            "is_mean": [h["importance_ratio/mean"] for h in logs if "importance_ratio/mean" in h],
            "is_min": [h["sampling/importance_sampling_ratio/min"] for h in logs
                       if "sampling/importance_sampling_ratio/min" in h],
            "params": _full_params(trainer.model)}


def _full_params(model: torch.nn.Module) -> dict:
    """Every parameter in full (gathered from ZeRO-3's partitions on every rank: a collective)."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return {k: v.detach().clone() for k, v in model.named_parameters()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def _seqpar_train(cfg_dict: dict) -> list[float]:
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return train(config_from_dict(cfg_dict)).losses


def _train_cfg(model_dir: Path, data: Path, out: Path) -> dict:
    """`seqpar train`'s run of the same settings as _grpo_config."""
    return {
        "model": {"name": str(model_dir)}, "dataset": {"path": str(data), "max_length": 48, "shuffle": False},
        "stage": "grpo", "sequence_parallel": {"size": 1}, "micro_batch_size": 4, "grad_accum": 1, "max_steps": 2,
        "seed": 9, "output_dir": str(out), "optimizer": {"name": "sgd", "lr": 0.5}, "checkpoint": {"every": 0},
        "progress": False, "export": {"final": True}, "memory": {"measure": False},
        "grpo": {"reward_funcs": ["vllm_rewards:low_ids"], "num_generations": 2, "max_prompt_length": 24,
                 "max_completion_length": 12, "temperature": 0.7, "beta": 0.04, "log_rollouts": True,
                 "importance_correction": "sequence_mask", "rollout": {"engine": "vllm", "max_model_len": 48}},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("trl_vllm")
    _save_model(d / "model")
    with open(d / "prompts.jsonl", "w") as f:
        for r in PROMPTS:
            f.write(json.dumps(r) + "\n")
    sp2 = run_distributed(_dropin, 2, str(d / "model"), str(d / "sp2"), 2, timeout=420)
    sp1 = run_distributed(_dropin, 1, str(d / "model"), str(d / "sp1"), 1, timeout=420)
    train = run_distributed(_seqpar_train, 1, _train_cfg(d / "model", d / "prompts.jsonl", d / "train"),
                            timeout=420)
    return {"dir": d, "sp2": sp2, "sp1": sp1[0], "train": train[0]}


def test_dropin_sp2_equals_sp1(runs):
    a, b = runs["sp2"][0], runs["sp1"]
    assert runs["sp2"][1]["drawn"] == a["drawn"]  # both ranks of the SP group hold the group's rows
    assert a["drawn"] == b["drawn"] and len(a["drawn"]) == 2 and len(a["drawn"][0]) == 4  # 2 steps x 4 rows
    assert len({tuple(r) for step in a["drawn"] for r in step}) > 4  # sampled, not one constant row
    assert len(a["losses"]) == len(b["losses"]) == 2
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < TOL, (a["losses"], b["losses"])
    dparam = max(float((a["params"][k] - v).abs().max()) for k, v in b["params"].items())
    assert dparam < TOL, dparam
    moved = max(float((b["params"][k] - v).abs().max()) for k, v in _initial(runs).items())
    assert moved > 1e-3, moved  # the steps did update the policy (else step 2 would not test the weight push)
    for r in (a, b):
        assert len(r["diff_max"]) == 2 and max(r["diff_max"]) < LP_TOL, r["diff_max"]
        # TRL's default correction (sequence_mask, clip_max 3) is on: ratios ~1, none masked
        assert len(r["is_mean"]) == 2 and max(abs(x - 1) for x in r["is_mean"]) < 1e-3, r["is_mean"]
        assert len(r["is_min"]) == 2 and min(r["is_min"]) > 0.99, r["is_min"]  # TRL's metric name, logged


def _initial(runs) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(runs["dir"] / "model", dtype=torch.float32)
    return {k: v.detach() for k, v in m.named_parameters()}


def test_dropin_equals_seqpar_train(runs):
    d, b = runs["dir"], runs["sp1"]
    rows = [json.loads(line) for line in open(d / "train" / "rollouts.jsonl")]
    got = [[r["prompt_ids"] + [-1] + r["completion_ids"] for r in rows if r["step"] == s] for s in (1, 2)]
    assert got == b["drawn"]
    assert max(abs(x - y) for x, y in zip(runs["train"], b["losses"])) < TOL, (runs["train"], b["losses"])
    from transformers import AutoModelForCausalLM

    final = dict(AutoModelForCausalLM.from_pretrained(_export_dir(d / "train"), dtype=torch.float32)
                 .named_parameters())
    dparam = max(float((final[k] - v).abs().max()) for k, v in b["params"].items())
    assert dparam < TOL, dparam


def _export_dir(out: Path) -> Path:
    found = [p.parent for p in out.rglob("config.json") if any(p.parent.glob("*.safetensors"))]
    assert found, sorted(str(p) for p in out.rglob("*"))
    return found[0]


@pytest.mark.slow
def test_dropin_dp2_equals_sp1(runs, tmp_path):
    """dp 2 x SP 1 (2 rows per rank: the SP 1 run's global batch): each dp rank samples its block of the step's rows
    with those rows' seeds, so the two ranks' completions together are the SP 1 run's; losses and parameters too."""
    d, b = runs["dir"], runs["sp1"]
    res = run_distributed(_dropin, 2, str(d / "model"), str(tmp_path / "dp2"), 1, per_device_train_batch_size=2,
                          timeout=420)
    assert [r0 + r1 for r0, r1 in zip(res[0]["drawn"], res[1]["drawn"])] == b["drawn"]
    assert max(abs(x - y) for x, y in zip(res[0]["losses"], b["losses"])) < TOL, (res[0]["losses"], b["losses"])
    got = {k.replace("module.", ""): v for k, v in res[0]["params"].items()}  # DDP's prefix, if any
    dparam = max(float((got[k] - v).abs().max()) for k, v in b["params"].items())
    assert dparam < TOL, dparam


@pytest.mark.slow
def test_dropin_zero3_sp2_equals_sp1(tmp_path):
    """DeepSpeed ZeRO-3 (every parameter partitioned; the push streams them one at a time, seqpar.hf.weight_stream)
    at SP 2 on 2 ranks vs the plain SP 1 run: the same completions, losses and parameters within 1e-5, the engine's
    log-probs within 1e-4 of the trainer's at both steps (a push that missed the partitions would be far off)."""
    pytest.importorskip("deepspeed")
    _save_model(tmp_path / "model")
    b = run_distributed(_dropin, 1, str(tmp_path / "model"), str(tmp_path / "sp1"), 1, timeout=420)[0]
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0}
    res = run_distributed(_dropin, 2, str(tmp_path / "model"), str(tmp_path / "z3"), 2, deepspeed=ds, timeout=600)
    a = res[0]
    assert a["zero3"] and res[1]["drawn"] == a["drawn"]
    assert a["drawn"] == b["drawn"]
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < TOL, (a["losses"], b["losses"])
    dparam = max(float((a["params"][k] - v).abs().max()) for k, v in b["params"].items())
    assert dparam < TOL, dparam
    assert len(a["diff_max"]) == 2 and max(a["diff_max"]) < LP_TOL, a["diff_max"]


@pytest.mark.slow
def test_dropin_lora_sp2_equals_sp1(tmp_path):
    """LoRA (peft_config=): the engine samples the merged adapters (the logged mismatch stays below 1e-4 at step 2,
    after the adapters moved); SP 2 on 2 ranks vs SP 1: the same completions and parameters within 1e-5."""
    _save_model(tmp_path / "model")
    m = str(tmp_path / "model")
    sp2 = run_distributed(_dropin, 2, m, str(tmp_path / "sp2"), 2, lora=True, learning_rate=2.0, timeout=420)[0]
    sp1 = run_distributed(_dropin, 1, m, str(tmp_path / "sp1"), 1, lora=True, learning_rate=2.0, timeout=420)[0]
    assert sp2["drawn"] == sp1["drawn"]
    assert max(abs(x - y) for x, y in zip(sp2["losses"], sp1["losses"])) < TOL, (sp2["losses"], sp1["losses"])
    assert max(float((sp2["params"][k] - v).abs().max()) for k, v in sp1["params"].items()) < TOL
    lora_b = [v for k, v in sp1["params"].items() if "lora_B" in k]
    assert lora_b and max(float(v.abs().max()) for v in lora_b) > 1e-3  # the adapters moved
    for r in (sp1, sp2):
        assert max(r["diff_max"]) < LP_TOL, r["diff_max"]
    # step 2's completions under the base weights (no adapter delta) are far from what the engine logged: a push
    # without the merged adapters would show in the mismatch above
    stale = _base_logprob_gap(m, sp1["drawn"][1], sp1["engine_lps"][1], 0.7)
    assert stale > 1e-3, stale


def _base_logprob_gap(model_dir: str, rows: list, engine_lps: list, temperature: float) -> float:
    """Max |engine log-prob - the saved (base) model's log_softmax(logits / T)| over the rows' completion tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for row, lps in zip(rows, engine_lps):
            cut = row.index(-1)
            p, c = row[:cut], row[cut + 1:]
            logits = model(torch.tensor([p + c])).logits[0].float() / temperature
            ref = torch.log_softmax(logits, -1)[len(p) - 1:len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None])
            worst = max(worst, float((ref[:, 0] - torch.tensor(lps)).abs().max()))
    return worst


def test_refusals(tmp_path):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqpar.trl import SequenceParallelGRPOTrainer

    _save_model(tmp_path / "m8", head_dim=8)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m8", dtype=torch.float32)
    with pytest.raises(SeqParError) as e:
        SequenceParallelGRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                    args=_grpo_config(str(tmp_path / "o")),
                                    train_dataset=datasets.Dataset.from_list(PROMPTS),
                                    processing_class=AutoTokenizer.from_pretrained(tmp_path / "m8"),
                                    sequence_parallel_size=1)
    msg = str(e.value)
    assert "use_vllm=True: head_dim=8 is not one vLLM's CPU attention runs" in msg and "use_vllm=False" in msg
    assert "\n" not in msg
    _save_model(tmp_path / "m32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m32", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m32")
    said = run_threaded(_construct, 2, model, tok, str(tmp_path / "t"), timeout=120)
    assert said[0] == said[1] and "use_vllm=True: the vLLM engine needs ranks that are processes" in said[0], said


def _construct(model, tok, out: str) -> str:
    """A drop-in with use_vllm built on a rank that is a thread: the one-line refusal (or 'no error')."""
    import datasets

    from seqpar.trl import SequenceParallelGRPOTrainer

    try:
        SequenceParallelGRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                    args=_grpo_config(out), train_dataset=datasets.Dataset.from_list(PROMPTS),
                                    processing_class=tok, sequence_parallel_size=2)
    except SeqParError as e:
        return str(e)
    return "no error"
