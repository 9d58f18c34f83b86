"""seqpar.trl.SequenceParallelGRPOTrainer: a TRL GRPO script gains SP by changing the class name.

Reference: the STOCK trl.GRPOTrainer, one process, no SP, in the test process. SP run: the seqpar
class in a spawned gloo world. Matching: the same tiny 2-layer Llama (saved to a folder and loaded by
path in both runs, so TRL's reference model for beta > 0 reloads it), the same prompts and seed (TRL's
RepeatSampler gives the same global prompt order; seqpar shards its generation batches over dp), and
the SAME completions: `trl.GRPOTrainer._generate_single_turn` is replaced in both runs by a
deterministic function of the prompt ids (the seqpar class still runs it, SP paused, on each SP
rank's share of the rows and all-gathers), so rewards and advantages agree too. One micro-batch per step
(grad accumulation 1; the stock batch holds the rows of all dp ranks), so TRL's per-micro-batch
normalisation equals seqpar's step normalisation. SGD lr 0.1 with TRL's default clipping (max_grad_norm 1.0),
2 steps; per step the gradient norm before clipping (1e-5 relative), logged losses and the updated
parameters compared at fp32 1e-5 absolute.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from seqpar.spawn import run_distributed

TOL = 1e-5
WORDS = "the cat sat on a mat while dogs ran far and birds sang songs of long summer days".split()
NUM_GEN = 2


def _tok():
    from seqpar.hf import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def _dataset():
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        n = int(torch.randint(3, 10, (1,), generator=g))
        rows.append({"prompt": " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))})
    return datasets.Dataset.from_list(rows)


def reward_chars(completions, **kwargs):
    """Toy reward: varies with the completion text (TRL names the metric after the function)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _fake_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Deterministic completions: the k-th copy of a prompt in this call gets its own ids and length."""
    seen: dict[tuple, int] = {}
    out = []
    for ids in prompt_ids:
        k = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
        n = 3 + (sum(ids) + 3 * k) % 6  # 3..8 tokens (<= max_completion_length)
        out.append([100 + (sum(ids) * 31 + 17 * k + 7 * t) % 5000 for t in range(n)])
    return out, None


def _config(case: dict, out: str, batch: int):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1, max_steps=2,
                      num_generations=NUM_GEN, max_completion_length=8, logging_steps=1, report_to=[],
                      save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=False, optim="sgd",
                      learning_rate=0.1, max_grad_norm=1.0, beta=case["beta"], loss_type=case["loss"],
                      gradient_checkpointing=False, **case.get("extra", {}))


def _train(case: dict, model_dir: str, out: str, sp: int | None):
    """Stock TRL when sp is None, else the seqpar class with sequence_parallel_size=sp: the only difference."""
    import trl
    from transformers import AutoModelForCausalLM

    import seqpar.trl as strl

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dp = case.get("dp", 1)
    kw = {} if sp is None else {"sequence_parallel_size": sp}
    cls = trl.GRPOTrainer if sp is None else strl.SequenceParallelGRPOTrainer
    batch = 4 * dp if sp is None else 4
    trainer = cls(model=model, reward_funcs=reward_chars, args=_config(case, out, batch), train_dataset=_dataset(),
                  processing_class=_tok(), **kw)
    # the stock run is in the test process: put TRL's generation back afterwards (later tests sample for real)
    with mock.patch.object(trl.GRPOTrainer, "_generate_single_turn", _fake_generate):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    gnorms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    params = {k.replace("module.", ""): v.detach().clone() for k, v in trainer.model.named_parameters()}
    return losses, params, gnorms


# beta > 0: the KL gradient only shows from step 2 (at step 1 policy == reference). TRL's default
# use_bias_correction_kl=True multiplies the k3 KL by the importance ratio (a different gradient, the same
# value on-policy): seqpar follows the flag; both settings are compared (slow; the fast twin: TRL's default).
CASES = [
    {"name": "grpo beta0", "loss": "grpo", "beta": 0.0},
    {"name": "bnpo beta0", "loss": "bnpo", "beta": 0.0},
    {"name": "grpo beta0.1 (fast twin of BETA_CASES)", "loss": "grpo", "beta": 0.1},
]
BETA_CASES = [
    {"name": "grpo beta0.2", "loss": "grpo", "beta": 0.2},
    {"name": "bnpo beta0.2", "loss": "bnpo", "beta": 0.2},
    {"name": "bnpo beta0.2 no kl correction", "loss": "bnpo", "beta": 0.2,
     "extra": {"use_bias_correction_kl": False}},
]
# dp 2 x sp 2: its fast twin runs in tests/test_trl_dp2.py's 4-rank world
SLOW_CASES = [{"name": "dp2 x sp2 bnpo beta0", "loss": "bnpo", "beta": 0.0, "dp": 2}]


def _sp_world(cases: list[dict], model_dir: str, refs: str, out: str) -> list[dict]:
    world = torch.distributed.get_world_size()
    ref = torch.load(refs)
    res = []
    for i, case in enumerate(cases):
        losses, params, gnorms = _train(case, model_dir, f"{out}/{i}", world // case.get("dp", 1))
        ref_losses, ref_params, ref_gnorms = ref[i]
        res.append({"name": case["name"], "losses": losses, "ref_losses": ref_losses,
                    "ngnorms": (len(gnorms), len(ref_gnorms)),
                    "dgnorm": max(abs(a - b) / b for a, b in zip(gnorms, ref_gnorms)),
                    "dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                    "dparam": max(float((params[k] - v).abs().max()) for k, v in ref_params.items()),
                    "moved": max(float((params[k] - v).abs().max()) for k, v in ref[-1].items())})
    return res


def _references(cases: list[dict], tmp_path, arch: str = "llama", heads: tuple[int, int] = (4, 2)) -> tuple[str, str]:
    """Save the tiny model, run stock TRL on every case here; (model folder, file of the references and the initial
    parameters) for _sp_world."""
    from transformers import AutoModelForCausalLM

    from seqpar.hf import tiny_model

    model_dir = str(tmp_path / "tiny")
    tiny_model(arch, *heads, vocab_size=len(_tok()), seed=0).save_pretrained(model_dir)
    init = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    refs = [_train(c, model_dir, str(tmp_path / f"ref{i}"), None) for i, c in enumerate(cases)]
    torch.save([*refs, {k: v.detach() for k, v in init.items()}], tmp_path / "refs.pt")
    return model_dir, str(tmp_path / "refs.pt")


def _check(results: list[list[dict]]) -> None:
    for rank_res in results[1:]:
        assert [r["losses"] for r in rank_res] == [r["losses"] for r in results[0]]
    for r in results[0]:  # all printed first, then checked
        print(f"{r['name']}: max rel dgrad_norm {r['dgnorm']:.2e}  max |dloss| {r['dloss']:.2e}  "
              f"max |dparam| {r['dparam']:.2e}  (moved {r['moved']:.2e})")
    for r in results[0]:
        assert len(r["losses"]) == len(r["ref_losses"]) == 2, r
        assert r["ngnorms"] == (2, 2) and r["dgnorm"] <= TOL, r
        assert r["moved"] > 1e-3, r  # the step changed the parameters: the comparison is not vacuous
        assert r["dloss"] <= TOL and r["dparam"] <= TOL, r


def _run(cases: list[dict], world: int, tmp_path, arch: str = "llama", heads: tuple[int, int] = (4, 2)) -> None:
    model_dir, refs = _references(cases, tmp_path, arch, heads)
    _check(run_distributed(_sp_world, world, cases, model_dir, refs, str(tmp_path / "sp"), timeout=480))


def test_grpo_sp2_matches_stock_trl(tmp_path):
    _run(CASES, 2, tmp_path)


@pytest.mark.slow
def test_grpo_sp2_beta_matches_stock_trl(tmp_path):
    _run(BETA_CASES, 2, tmp_path)


@pytest.mark.slow
def test_grpo_dp2_matches_stock_trl(tmp_path):
    _run(SLOW_CASES, 4, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_grpo_hybrid_ring_matches_stock_trl(tmp_path, arch):
    """A Gated DeltaNet (Qwen3.5) and a Mamba2 (Nemotron-H) hybrid with 3 q / 1 kv heads: the automatic mesh at
    SP=2 is a ring, so the recurrent layers pass state; vs stock TRL's GRPOTrainer."""
    _run(CASES[:1], 2, tmp_path, arch, (3, 1))


# ---------------------------------------------------------------------------- (a) completions per SP group
def _generation_world(model_dir: str, out: str) -> dict:
    """Real sampling (TRL's generate path) with a DIFFERENT torch seed per rank: each SP rank samples one of the
    two prompt groups, the group gets the same gathered completions and the same RNG state afterwards; the
    layer checkpointing (every_n_layers=2 over 4 layers: [T, F, T, F]) is the same after generation on every
    rank (TRL re-enabled it on the generating ranks with every layer checkpointed)."""
    import trl
    from transformers import AutoModelForCausalLM

    import seqpar.trl as strl

    rank = torch.distributed.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = _config({"beta": 0.0, "loss": "grpo"}, out, 4)
    args.temperature = 1.0
    args.gradient_checkpointing = True  # TRL's generation re-enables it with these (stored) kwargs
    args.gradient_checkpointing_kwargs = {"every_n_layers": 2}
    trainer = strl.SequenceParallelGRPOTrainer(model=model, reward_funcs=reward_chars, args=args,
                                               train_dataset=_dataset(), processing_class=_tok(),
                                               sequence_parallel_size=2)
    assert trl.GRPOTrainer._generate_single_turn is not _fake_generate
    tok = _tok()
    prompts = [tok.encode(r["prompt"]) for r in _dataset()][:2]
    prompts = [p for p in prompts for _ in range(NUM_GEN)]
    from seqpar.memory.checkpointing import enable_activation_checkpointing

    enable_activation_checkpointing(trainer.model, every_n_layers=2)  # as Trainer.train() turns it on
    layers = trainer.model.model.layers
    before = [bool(m.gradient_checkpointing) for m in layers]
    torch.manual_seed(1000 + rank)
    ids, _ = trainer._generate_single_turn(prompts, None, {}, NUM_GEN)
    return {"ids": ids, "after": torch.rand(3).tolist(), "ckpt": (before, [bool(m.gradient_checkpointing)
                                                                           for m in layers])}


def test_completions_identical_over_sp_group(tmp_path):
    from seqpar.hf import tiny_model

    model_dir = str(tmp_path / "tiny")
    tiny_model("llama", 4, 2, vocab_size=len(_tok()), seed=0, num_layers=4).save_pretrained(model_dir)
    res = run_distributed(_generation_world, 2, model_dir, str(tmp_path / "gen"), timeout=600)
    for r in res:
        assert r["ckpt"] == ([True, False, True, False],) * 2, r["ckpt"]
    assert res[0]["ids"] == res[1]["ids"]
    assert res[0]["after"] == res[1]["after"]
    assert len(res[0]["ids"]) == 2 * NUM_GEN and all(1 <= len(c) <= 8 for c in res[0]["ids"])
    assert len({tuple(c) for c in res[0]["ids"]}) > 1  # sampled, not a constant


# ---------------------------------------------------------------------------- (c) refusals
@pytest.mark.parametrize("extra, match", [
    ({"loss_type": "dapo"}, "loss_type='dapo'"),
    ({"num_iterations": 2}, "num_iterations=2"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_correction": False},
     "vllm_mode='server' .*use vllm_mode='colocate'"),
    ({"use_vllm": True, "vllm_tensor_parallel_size": 2, "vllm_importance_sampling_correction": False},
     "vllm_tensor_parallel_size=2 .*set vllm_tensor_parallel_size=1"),
    ({"use_vllm": True, "vllm_model_impl": "transformers", "vllm_importance_sampling_correction": False},
     "vllm_model_impl='transformers'"),
    ({"use_vllm": True, "generation_kwargs": {"seed": 1}, "vllm_importance_sampling_correction": False},
     "generation_kwargs= .*drop generation_kwargs"),
    ({"use_vllm": True, "min_p": 0.1, "vllm_importance_sampling_correction": False}, "min_p=0.1"),
    ({"use_vllm": True, "repetition_penalty": 1.2, "vllm_importance_sampling_correction": False},
     "repetition_penalty=1.2"),
    ({"use_vllm": True, "vllm_structured_outputs_regex": "a+", "vllm_importance_sampling_correction": False},
     "vllm_structured_outputs_regex="),
    ({"use_vllm": True, "vllm_max_model_length": 8, "vllm_importance_sampling_correction": False},
     "vllm_max_model_length=8 .*max_completion_length=8"),
    # the main environment has no vLLM: the drop-in says where it is (tests/vllm_env runs use_vllm there)
    # (TRL's default importance sampling, sequence_mask, is mapped: the vLLM check is the first to refuse)
    ({"use_vllm": True}, "use_vllm=True needs vLLM.*make vllm-env"),
    ({"use_liger_kernel": True}, "use_liger_kernel"),
    ({"steps_per_generation": 2}, "steps_per_generation"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
    ({"entropy_coef": 0.1}, "entropy"),
])
def test_refusals(tmp_path, extra, match):
    from trl import GRPOConfig

    from seqpar.errors import SeqParError
    from seqpar.hf import tiny_model
    from seqpar.trl import SequenceParallelGRPOTrainer

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, report_to=[],
                use_cpu=True, max_completion_length=8)
    loss = extra.pop("loss_type", "grpo")
    args = GRPOConfig(**base, loss_type=loss, **extra)  # TRL 1.16 takes each (were one refused, this fails)
    with pytest.raises(SeqParError, match=match) as e:
        SequenceParallelGRPOTrainer(model=tiny_model("llama", 4, 2, vocab_size=64, seed=0), reward_funcs=reward_chars,
                                    args=args, train_dataset=_dataset(), sequence_parallel_size=1)
    assert "\n" not in str(e.value)


ON = {"vllm_importance_sampling_correction": True}


@pytest.mark.parametrize("extra, want", [
    ({}, None),  # vllm_importance_sampling_correction off: no correction
    (ON, ("sequence", "mask", None, 3.0)),  # TRL's defaults
    ({**ON, "vllm_importance_sampling_mode": "token_truncate"}, ("token", "truncate", None, 3.0)),
    ({**ON, "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_cap": 2.0},
     ("token", "truncate", None, 2.0)),  # TRL's deprecated name, copied into clip_max by GRPOConfig
    ({**ON, "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5},
     ("token", "mask", 0.5, 3.0)),
    ({**ON, "vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_clip_min": 0.2,
      "vllm_importance_sampling_clip_max": 4.0}, ("sequence", "truncate", 0.2, 4.0)),
    ({**ON, "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": None},
     ("sequence", "mask", 0.5, None)),  # TRL: mask below clip_min only
    # GRPOConfig refuses these two itself; set afterwards, seqpar refuses them too
    ({**ON, "vllm_importance_sampling_mode": "token_truncate", "_after": {"vllm_importance_sampling_clip_max": None}},
     "without bounds"),
    ({**ON, "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": -1.0},
     "vllm_importance_sampling_clip_max=-1.0"),
    ({**ON, "_after": {"vllm_importance_sampling_clip_min": 4.0}}, "vllm_importance_sampling_clip_min=4.0"),
    ({**ON, "vllm_importance_sampling_mode": "seq_mask"}, "vllm_importance_sampling_mode='seq_mask'"),
])
def test_importance_sampling_from_trl_options(tmp_path, extra, want):
    """TRL's vLLM importance-sampling options as seqpar's ImportanceSampling (StepSpec.importance)."""
    from trl import GRPOConfig

    from seqpar.errors import SeqParError
    from seqpar.trl.grpo_vllm import importance_sampling

    extra = dict(extra)
    after = extra.pop("_after", {})
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, loss_type="grpo", use_vllm=True,
                      **{"vllm_importance_sampling_correction": False, **extra})
    for k, v in after.items():
        setattr(args, k, v)
    if isinstance(want, str):
        with pytest.raises(SeqParError, match=want) as e:
            importance_sampling("T", args)
        assert "\n" not in str(e.value)
    else:
        got = importance_sampling("T", args)
        assert (got if got is None else (got.level, got.mode, got.clip_min, got.clip_max)) == want


def test_refuses_tools_and_eval(tmp_path):
    from trl import GRPOConfig

    from seqpar.errors import SeqParError
    from seqpar.hf import tiny_model
    from seqpar.trl import SequenceParallelGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, report_to=[],
                      use_cpu=True, loss_type="grpo")
    model = tiny_model("llama", 4, 2, vocab_size=64, seed=0)
    with pytest.raises(SeqParError, match="tools="):
        SequenceParallelGRPOTrainer(model=model, reward_funcs=reward_chars, args=args, train_dataset=_dataset(),
                                    tools=[reward_chars])
    with pytest.raises(SeqParError, match="evaluation"):
        SequenceParallelGRPOTrainer(model=model, reward_funcs=reward_chars, args=args, train_dataset=_dataset(),
                                    eval_dataset=_dataset())


def reward_fails_on_rank1(completions, **kwargs):
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("reward server unreachable from rank 1")
    return [1.0] * len(completions)


def _reward_fails_world(out: str) -> str:
    import trl

    from seqpar.errors import SeqParError
    from seqpar.hf import tiny_model
    from seqpar.trl import SequenceParallelGRPOTrainer

    trl.GRPOTrainer._generate_single_turn = _fake_generate
    tok = _tok()
    trainer = SequenceParallelGRPOTrainer(
        model=tiny_model("llama", 4, 2, num_layers=1, vocab_size=len(tok), seed=0), reward_funcs=reward_fails_on_rank1,
        args=_config({"loss": "grpo", "beta": 0.0}, out, 4), train_dataset=_dataset(), processing_class=tok,
        sequence_parallel_size=1)
    try:
        trainer.train()
    except SeqParError as e:
        return str(e)
    return "no error"


def test_reward_error_on_one_dp_rank_stops_every_rank(tmp_path):
    """dp 2: each rank scores its own rows, and a reward function failing on rank 1 only used to leave rank 0
    waiting in TRL's gather (until the collective timeout): both ranks stop with the same one-line SeqParError."""
    said = run_distributed(_reward_fails_world, 2, str(tmp_path), timeout=300)
    assert said[0] == said[1], said
    assert said[0].startswith("scoring failed on rank 1 (every rank stops): RuntimeError: reward server unreachable "
                              "from rank 1"), said


GRPO_STACK_SCRIPT = r'''
import sys, json
import torch
from trl import GRPOConfig
from transformers import AutoModelForCausalLM
from seqpar.hf import load_smollm2_tokenizer
from seqpar.trl import SequenceParallelGRPOTrainer
import datasets

stack, out, batch, beta = sys.argv[1], sys.argv[2], int(sys.argv[4]), float(sys.argv[5])
zero3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0}
kw = ({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if stack == "fsdp2" else
      {"deepspeed": zero3} if stack == "zero3" else
      {"deepspeed": zero3, "ds3_gather_for_generation": False} if stack == "zero3-fetch" else {})
args = GRPOConfig(output_dir=out, per_device_train_batch_size=batch, num_generations=2, report_to=[], use_cpu=True,
                  max_completion_length=8, bf16=False, loss_type="grpo", beta=beta, max_steps=2, seed=0,
                  optim="sgd", learning_rate=0.1, logging_steps=1, save_strategy="no", disable_tqdm=True,
                  temperature=1.0, **kw)
ds = datasets.Dataset.from_list([{"prompt": "ab" * (i + 1)} for i in range(8)])
rank = __import__('os').environ['RANK']


class Recording(SequenceParallelGRPOTrainer):
    completions: list = []

    def _generate_single_turn(self, *a, **k):
        ids, logprobs = super()._generate_single_turn(*a, **k)
        self.completions.append([list(c) for c in ids])
        return ids, logprobs


tok = load_smollm2_tokenizer()
# Loaded after the config, as users do: under ZeRO-3 from_pretrained partitions the saved weights at load.
model = AutoModelForCausalLM.from_pretrained(sys.argv[3], dtype=torch.float32)
sharded = any(hasattr(p, "ds_id") for p in model.parameters())


def full_params(m):
    if not any(hasattr(p, "ds_id") for p in m.parameters()):
        return {k.replace("module.", ""): (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in m.state_dict().items()}
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(m.parameters())):
        return {k: v.detach().clone() for k, v in m.named_parameters()}


trainer = Recording(model=model, processing_class=tok, args=args, train_dataset=ds,
                    reward_funcs=lambda completions, **k: [float(sum(map(ord, c)) % 7) for c in completions],
                    sequence_parallel_size=2)
trainer.train()
sd = full_params(trainer.model)
log = trainer.state.log_history
if rank == "0":
    torch.save({"losses": [h["loss"] for h in log if "loss" in h], "params": sd,
                "grad_norms": [h["grad_norm"] for h in log if "grad_norm" in h],
                "completions": trainer.completions, "sharded": sharded,
                "wrapped": type(trainer.model_wrapped).__name__,
                "lengths": [h.get("completions/mean_length") for h in log if "loss" in h]},
               f"{out}/result.pt")
'''


def _stack_run(tmp_path, stack: str, batch: int = 4, beta: float = 0.0):
    import sys

    from procs import run_script

    model_dir = tmp_path / "model"
    if not model_dir.exists():  # saved once, before any launch (ranks would race to write it)
        from seqpar.hf import tiny_model

        model = tiny_model("llama", 4, 2, vocab_size=len(_tok()), seed=0)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)  # a peaked distribution (completions repeat tokens)
        model.save_pretrained(model_dir)
    out = tmp_path / f"{stack}-{batch}-{beta}"
    out.mkdir()
    script = tmp_path / "grpo_stack.py"
    script.write_text(GRPO_STACK_SCRIPT)
    run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                stack, str(out), str(model_dir), str(batch), str(beta)], tmp_path, timeout=400)
    return out


def _init_params(tmp_path) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


def _same_run(got: dict, ddp: dict, init: dict) -> None:
    """Completions identical, losses and parameters within 1e-5 absolute, gradient norms 1e-5 relative (absolute
    below 1), and the
    parameters moved (so the comparison is not vacuous)."""
    print("losses", got["losses"], ddp["losses"], "grad norms", got["grad_norms"], ddp["grad_norms"],
          "max |dparam|", max(float((got["params"][k] - v).abs().max()) for k, v in ddp["params"].items()))
    assert len(got["losses"]) == 2 and got["completions"] == ddp["completions"]
    assert len(ddp["completions"]) == 2 and len({tuple(c) for step in ddp["completions"] for c in step}) > 1
    assert max(abs(a - b) for a, b in zip(got["losses"], ddp["losses"])) <= TOL
    assert len(got["grad_norms"]) == 2 and all(abs(a - b) <= TOL * max(b, 1.0)  # a step can have no signal: 0
                                               for a, b in zip(got["grad_norms"], ddp["grad_norms"]))
    assert got["params"].keys() == ddp["params"].keys()
    assert max(float((got["params"][k] - v).abs().max()) for k, v in ddp["params"].items()) <= TOL
    assert max(float((ddp["params"][k] - v).abs().max()) for k, v in init.items()) > 1e-3


def test_zero3_partitioned_model_generates_on_every_rank():
    """Fast guard: a ZeRO-3-partitioned model (parameters carrying ds_id) counts as sharded, so a rank of the SP
    group without prompts still makes its one generate() (share_rollout): TRL's gathers then run on every rank."""
    from seqpar.hf.generation import is_sharded

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not is_sharded(model)
    model[0].weight.ds_id = 0  # what deepspeed.zero.Init / ZeRO-3's engine sets on every partitioned parameter
    assert is_sharded(model)


@pytest.mark.slow
@pytest.mark.parametrize("stack, batch, beta", [("zero3", 4, 0.0), ("zero3-fetch", 4, 0.0), ("zero3", 2, 0.0),
                                                ("zero3", 4, 0.2)])
def test_grpo_zero3_matches_ddp(tmp_path, stack, batch, beta):
    """DeepSpeed ZeRO-3 through the TrainingArguments (refused before; it hung in the first rollout when only
    some ranks generated): SP=2 over 2 ranks, every rank samples one prompt group in one generate() (TRL's one
    GatheredParameters per rollout, or with ds3_gather_for_generation=False ZeRO-3's per-module fetches kept in
    step by synced_gpus); batch 2 = one prompt group for two ranks: SP rank 1 decodes a dummy row so that it
    joins the gathers; beta 0.2: TRL's reference (reloaded by name, its own ZeRO-3 engine) run under SP. Two SGD
    steps with real sampling vs the same run with DDP: the same completion ids, losses, gradient norms and
    parameters within 1e-5, no hang (spawn timeout)."""
    got = torch.load(_stack_run(tmp_path, stack, batch, beta) / "result.pt")
    ddp = torch.load(_stack_run(tmp_path, "ddp", batch, beta) / "result.pt")
    assert got["sharded"] and got["wrapped"] == "DeepSpeedEngine" and not ddp["sharded"]
    _same_run(got, ddp, _init_params(tmp_path))


@pytest.mark.slow
def test_grpo_fsdp2_matches_ddp(tmp_path):
    """FSDP2 through the TrainingArguments (refused before): SP=2 over 2 ranks, every rank samples one prompt
    group and joins every sharded generation forward (synced_gpus); two SGD steps with real sampling vs the same
    run with DDP: the same completions (lengths), losses and parameters within 1e-5, no hang (spawn timeout)."""
    fsdp = torch.load(_stack_run(tmp_path, "fsdp2") / "result.pt")
    ddp = torch.load(_stack_run(tmp_path, "ddp") / "result.pt")
    assert fsdp["lengths"] == ddp["lengths"]
    _same_run(fsdp, ddp, _init_params(tmp_path))
