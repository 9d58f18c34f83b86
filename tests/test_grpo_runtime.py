"""GRPO runtime: generation shared over the SP group, SP paused/restored, rewards, advantages, config refusals.

One spawned dp2 x sp2 gloo world (timeout 600 s) checks, on a tiny 2-layer Llama:
- completions are identical on the two ranks of an SP group (each rank sampled one of the two prompts)
  and differ between dp groups, and equal an independent single-process sampler with the same row seeds
  (the model never saw SP);
- the SP forward after generation equals the one before bit for bit (same logits, 0 difference),
  and `sequence_parallel_paused` puts back the same hook / config objects, also after an error;
- a reward function that raises on ONE dp rank only makes every rank raise the same SeqParError
  (agreed before any training collective, so nothing hangs).
The rest are plain unit tests (no spawn).
"""

from __future__ import annotations

import math

import pytest
import torch

from seqpar.errors import SeqParError
from seqpar.spawn import run_distributed
from seqpar.train.grpo.rewards import group_advantages, resolve_reward, score

PROMPTS = [[256, 104, 105], [256, 1, 2, 3, 4, 5]]  # byte-tokenizer ids (bos + bytes)
EOS, PAD = 257, 258


def _model():
    from seqpar.hf import tiny_model

    return tiny_model("llama", num_heads=4, num_kv_heads=2, vocab_size=259, seed=0)


def _flaky_reward(prompts, completions, **kw):
    import torch.distributed as dist

    if dist.get_rank() == 2:  # the first rank of dp group 1 only
        raise ValueError("boom on dp 1")
    return [1.0] * len(completions)


def _world_cases():
    import torch.distributed as dist

    from seqpar import init_mesh, shard
    from seqpar.hf import apply_sequence_parallel
    from seqpar.hf.generation import generate_for_group, sequence_parallel_paused
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prompts import PromptRow
    from seqpar.train.grpo.rollout import GRPORollout
    from seqpar.train.model.tokenizers import ByteTokenizer

    mesh = init_mesh(2, ulysses_degree=2)
    model = apply_sequence_parallel(_model(), mesh)
    ids = torch.arange(32).reshape(2, 16) % 250
    pos = torch.arange(16).expand(2, 16)
    before = model(input_ids=shard(ids, mesh, dim=1), position_ids=shard(pos, mesh, dim=1)).logits
    backbone = model.model
    hooks_before = list(backbone._forward_pre_hooks_with_kwargs.items())
    cfg_before = model.config
    comps = generate_for_group(model, mesh, PROMPTS, num_generations=3, max_new_tokens=8, temperature=1.0,
                               seed=5, step=1, eos_token_id=EOS, pad_token_id=PAD)
    after = model(input_ids=shard(ids, mesh, dim=1), position_ids=shard(pos, mesh, dim=1)).logits
    try:
        with sequence_parallel_paused(model):
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    restored = (list(backbone._forward_pre_hooks_with_kwargs.items()) == hooks_before and model.config is cfg_before)
    # A reward function failing on one dp rank: every rank raises the same error.
    cfg = config_from_dict({"model": "tiny:llama", "dataset": {"path": "x.jsonl", "max_length": 64},
                            "stage": "grpo", "micro_batch_size": 2, "grad_accum": 1,
                            "grpo": {"reward_funcs": [f"{__name__}:_flaky_reward"], "num_generations": 2,
                                     "max_prompt_length": 16, "max_completion_length": 8}})
    ro = GRPORollout(cfg, mesh, ByteTokenizer(), [], collator=None)
    try:
        ro.rollout(model, [PromptRow("hi", PROMPTS[0])], step=0)
        err = None
    except SeqParError as e:
        err = str(e)
    dist.barrier()
    return {"comps": comps, "same_forward": float((after - before).abs().max()), "restored": restored,
            "err": err, "dp": mesh.dp_rank}


@pytest.fixture(scope="module")
def world():
    return run_distributed(_world_cases, 4, timeout=600)


def test_generation_identical_in_sp_group_different_over_dp(world):
    assert world[0]["comps"] == world[1]["comps"] and world[2]["comps"] == world[3]["comps"]
    assert world[0]["comps"] != world[2]["comps"]
    assert len(world[0]["comps"]) == 6 and all(1 <= len(c) <= 8 for c in world[0]["comps"])


def test_generation_matches_single_process_sampler(world):
    """Independent reference: a manual token-by-token sampler (full forward, softmax(logits / T), the row's
    generator seeded like seqpar's) on a model that never had SP. Each SP rank drew only its share of the
    prompts; the gathered completions equal the reference exactly (float noise could flip a draw only at a
    CDF boundary; none here)."""
    from test_grpo_rollout import manual_sample

    from seqpar.hf.generation import row_seed

    model = _model().eval()
    for dp, r in ((0, world[0]), (1, world[2])):
        ref = [manual_sample(model, p, row_seed(5, 1, dp, i, k), 8, EOS) for i, p in enumerate(PROMPTS)
               for k in range(3)]
        assert r["comps"] == ref


def test_sp_restored_after_generate(world):
    for r in world:
        assert r["same_forward"] == 0.0  # bitwise: the same SP forward before and after generation
        assert r["restored"]


def test_reward_error_raised_on_every_rank(world):
    msgs = {r["err"] for r in world}
    assert len(msgs) == 1 and None not in msgs
    msg = msgs.pop()
    assert "_flaky_reward" in msg and "boom on dp 1" in msg


# ----------------------------------------------------------------------------- rewards / advantages
def test_builtin_rewards_and_weights():
    per, total = score(["seqpar:length", "seqpar:contains"], [1.0, 2.0], ["p"] * 3, ["a 42", "no", "42!"],
                       [[1, 2, 3], [4], [5, 6]], {"answer": ["42", "42", None]})
    assert per.shape == (3, 2)
    assert torch.allclose(per[:, 0], torch.tensor([0.03, 0.01, 0.02], dtype=torch.float64))
    assert per[0, 1] == 1 and per[1, 1] == 0 and math.isnan(per[2, 1])
    # None -> NaN, skipped by the weighted nansum (TRL)
    assert torch.allclose(total, torch.tensor([0.03 + 2, 0.01, 0.02], dtype=torch.float64))


def test_advantages_match_formula():
    r = torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    a = group_advantages(r, 3, "group")
    g = r[:3]
    assert torch.allclose(a[:3], (g - g.mean()) / (g.std() + 1e-4), atol=1e-12)
    assert torch.equal(a[3:], torch.zeros(3, dtype=torch.float64))  # equal rewards: 0, not NaN
    assert torch.allclose(group_advantages(r, 3, "none")[:3], g - g.mean())


def _raises(*a, **k):
    raise KeyError("nope")


def _short(prompts, completions, **k):
    return [1.0]


def _text(prompts, completions, **k):
    return ["x"] * len(completions)


@pytest.mark.parametrize("path, needle", [
    (f"{__name__}:_raises", "raised KeyError"),
    (f"{__name__}:_short", "returned 1 values for 2 completions"),
    (f"{__name__}:_text", r"returned 'x' \(str\) for completion 0: return numbers"),
    (f"{__name__}:missing", "cannot be imported"),
    ("seqpar:nothing", "no such built-in"),
    ("no_colon", "package.module:function"),
])
def test_reward_bad_input(path, needle):
    with pytest.raises(SeqParError, match=needle):
        score([path], None, ["p", "p"], ["a", "b"], [[1], [2]], {})
    if path.endswith(":_raises"):
        with pytest.raises(SeqParError, match="_raises"):
            score([path], None, ["p", "p"], ["a", "b"], [[1], [2]], {})


def test_contains_needs_column():
    with pytest.raises(SeqParError, match="'answer'"):
        score(["seqpar:contains"], None, ["p"], ["a"], [[1]], {})
    assert resolve_reward("seqpar:match_answer")(["p"], [" 7 "], answer=["7"]) == [1.0]


# ----------------------------------------------------------------------------- config
def _cfg(**over):
    from seqpar.train.config import config_from_dict

    d = {"model": "tiny:llama", "dataset": {"path": "x.jsonl", "max_length": 64}, "stage": "grpo",
         "micro_batch_size": 2, "grad_accum": 2,
         "grpo": {"reward_funcs": ["seqpar:length"], "num_generations": 4, "max_prompt_length": 32,
                  "max_completion_length": 16}}
    for k, v in over.items():
        if k.startswith("grpo."):
            d["grpo"][k[5:]] = v
        else:
            d[k] = v
    return config_from_dict(d)


@pytest.mark.parametrize("over, needle", [
    ({"grpo.num_generations": 3}, "must divide micro_batch_size x grad_accum = 4"),
    ({"grpo.num_iterations": 2, "checkpoint": {"every": 3}}, "must be a multiple of grpo.num_iterations=2"),
    ({"grpo.importance_correction": "tis", "sequence_parallel": {"size": "dynamic", "max_local_tokens": 64}},
     "importance_correction: tis is not supported with sequence_parallel"),
    ({"grpo.importance_correction": "sequence_mask", "sequence_parallel": {"size": "dynamic", "max_local_tokens": 64}},
     "importance_correction: sequence_mask is not supported with sequence_parallel"),
    ({"grpo.importance_cap": 0}, "importance_cap"),
    ({"grpo.importance_min": 4.0}, "grpo.importance_min=4.0 > grpo.importance_cap=3.0"),
    ({"grpo.importance_correction": "sequence_truncate", "grpo.importance_cap": None}, "needs a bound"),
    ({"grpo.importance_correction": "seq_mask"}, "importance_correction"),
    ({"grpo.reward_weights": [1.0, 2.0]}, "one weight per function"),
    ({"grpo.loss_type": "ppo"}, "grpo.loss_type"),
    ({"grpo.max_completion_length": 40}, "set dataset.max_length: 72"),
    ({"grpo.epsilon_hi": 0.3}, "unknown key"),
    ({"stage": "sft"}, "only read with stage: grpo"),
])
def test_config_refusals(over, needle):
    with pytest.raises(SeqParError, match=needle):
        _cfg(**over)


@pytest.mark.parametrize("mode, min_, cap, want", [
    ("none", None, 3.0, None),
    ("tis", None, 3.0, ("token", "truncate", None, 3.0)),  # the alias of token_truncate (configs before the modes)
    ("token_mask", 0.5, 2.0, ("token", "mask", 0.5, 2.0)),
    ("sequence_truncate", 0.2, None, ("sequence", "truncate", 0.2, None)),
    ("sequence_mask", None, 3.0, ("sequence", "mask", None, 3.0)),
])
def test_importance_correction_to_step_spec(mode, min_, cap, want):
    from seqpar.train.grpo.rollout import grpo_step_spec

    got = grpo_step_spec(_cfg(**{"grpo.importance_correction": mode, "grpo.importance_min": min_,
                                 "grpo.importance_cap": cap})).importance
    assert (got if got is None else (got.level, got.mode, got.clip_min, got.clip_max)) == want


def test_config_ok_and_needs_section():
    from seqpar.train.config import config_from_dict

    c = _cfg(**{"grpo.scale_rewards": False})
    assert c.grpo.scale_rewards == "none" and c.grpo.num_iterations == 1
    with pytest.raises(SeqParError, match="needs a grpo: section"):
        config_from_dict({"model": "tiny:llama", "dataset": {"path": "x", "max_length": 64}, "stage": "grpo"})


def test_rollout_rows_empty_completion_counted(tmp_path):
    """EOS-first completions: one supervised token (the EOS), counted in completions_empty; prompts
    longer than max_prompt_length keep their end (counted)."""
    from seqpar import init_mesh
    from seqpar.data import SequenceParallelCollator
    from seqpar.train.dataset.prompts import PromptRow, load_prompts
    from seqpar.train.grpo.rollout import GRPORollout
    from seqpar.train.model.tokenizers import ByteTokenizer

    (tmp_path / "p.jsonl").write_text('{"prompt": "abcdefghijklmnopqrstuvwxyz0123456789", "answer": "x"}\n'
                                      '{"prompt": "hi", "answer": "y"}\n')
    cfg = _cfg(dataset={"path": str(tmp_path / "p.jsonl"), "max_length": 64}, micro_batch_size=2, grad_accum=1,
               **{"grpo.num_generations": 2})
    tok = ByteTokenizer()
    prompts, stats = load_prompts(cfg, tok)
    assert stats["rows"] == 2 and stats["prompt_truncated"] == 1
    assert prompts[0].prompt_ids == list(b"abcdefghijklmnopqrstuvwxyz0123456789"[-32:])
    assert prompts[1].columns == {"answer": "y"}
    mesh = init_mesh(1)
    ro = GRPORollout(cfg, mesh, tok, prompts, SequenceParallelCollator(mesh, tok.pad_token_id, max_length=64))
    rows = [PromptRow("hi", [104, 105])]
    comps = [[EOS], [1, 2, EOS]]
    per, total = score(["seqpar:length"], None, ["hi"] * 2, ["", ""], comps, {})
    adv = group_advantages(total, 2)
    (b,) = ro.micro_batches(rows, comps, adv)
    assert b["shift_labels"][0].tolist()[:3] == [-100, EOS, -100]  # only the EOS is supervised
    assert int(b["num_supervised_tokens"]) == 4 and b["advantages"].shape == (2,)
    m = ro.metrics(comps, (per, total))
    assert m["completions_empty"] == 1 and m["completion_length_min"] == 1 and m["completion_length_max"] == 3
    assert all(not math.isnan(v) for v in m.values())
