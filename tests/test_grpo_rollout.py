"""GRPO rollouts: exact sampling, prompts shared over the SP group, sharded (FSDP2) generation.

Reference everywhere: `manual_sample`, a token-by-token sampler written here (full forward on the
prefix, no cache, no padding, softmax(logits / T), optional top-k by hand, torch.multinomial with the
row's own generator seeded like seqpar's `row_seed`), on a model that never had SP or FSDP.
Completions are compared for equality (token ids). What could break equality: batching and left padding
change the logits by float rounding, which flips a draw only when a uniform lands within that rounding of
a CDF boundary (none in these cases). The tiny model's lm_head is scaled so its next-token distribution
is peaked (a near-uniform one would make temperature and penalties invisible).
"""

from __future__ import annotations

import pytest
import torch

from seqpar.spawn import run_distributed

EOS, PAD = 257, 258
PROMPTS = [[256, 104, 105], [256, 1, 2, 3, 4, 5], [256, 9], [256, 40, 41, 42]]


def peaked_model(seed: int = 0) -> torch.nn.Module:
    from seqpar.hf import tiny_model

    m = tiny_model("llama", num_heads=4, num_kv_heads=2, vocab_size=259, seed=seed)
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)
    return m


@torch.no_grad()
def manual_sample(model: torch.nn.Module, prompt: list[int], seed: int, max_new: int, eos: int,
                  temperature: float = 1.0, top_k: int = 0, banned: tuple[int, ...] = ()) -> list[int]:
    """One completion drawn token by token from softmax(logits / temperature) (top_k > 0: the k largest only;
    `banned` ids: probability 0)."""
    g = torch.Generator().manual_seed(int(seed))
    ids, out = list(prompt), []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
        logits[list(banned)] = float("-inf")
        if top_k:
            kth = logits.topk(top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        out.append(t)
        ids.append(t)
        if t == eos:
            break
    return out


def test_sampling_ignores_model_generation_config_extras():
    """Fast guard: the model's generation_config asks for repetition_penalty / min_p / top_k / no_repeat_ngram;
    seqpar's rollout samples exactly from softmax(logits / T) (top_k as configured), batched == per row."""
    from seqpar import init_mesh
    from seqpar.hf.generation import generate_for_group, row_seed

    model = peaked_model().eval()
    gc = model.generation_config
    gc.repetition_penalty, gc.min_p, gc.top_k, gc.no_repeat_ngram_size = 3.0, 0.2, 2, 2
    mesh = init_mesh(1)
    for temperature, top_k in ((0.7, 0), (1.3, 5)):
        got = generate_for_group(model, mesh, PROMPTS, num_generations=2, max_new_tokens=6, temperature=temperature,
                                 top_k=top_k, seed=4, step=2, eos_token_id=EOS, pad_token_id=PAD)
        ref = [manual_sample(model, p, row_seed(4, 2, 0, i, k), 6, EOS, temperature, top_k)
               for i, p in enumerate(PROMPTS) for k in range(2)]
        assert got == ref
        assert len({tuple(c) for c in got}) > 2  # sampled, not constant
    # The model's own config stays in place afterwards; a repeated token (which repetition_penalty 3.0 would
    # suppress) shows up, as the peaked model makes it likely.
    assert model.generation_config is gc and gc.repetition_penalty == 3.0
    assert any(len(set(c)) < len(c) for c in got)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_rollouts_never_draw_media_placeholders(arch, monkeypatch):
    """The shipped tiny VL models (random weights: every id about equally likely) put an image / video placeholder
    in some completion of this rollout when the sampler may draw one; seqpar's never does, and its completions are
    the manual sampler's over the other ids (top_k after the mask: k ids that may be drawn)."""
    import seqpar.hf.generation as generation
    from seqpar import init_mesh
    from seqpar.hf import tiny_model

    model = tiny_model(arch, vocab_size=259).eval()
    placeholders = (model.config.image_token_id, model.config.video_token_id)
    assert generation.placeholder_ids(model) == sorted(placeholders) == [259, 260]
    assert generation.placeholder_ids(peaked_model()) == []  # a text model: nothing banned
    mesh = init_mesh(1)
    kw = dict(num_generations=4, max_new_tokens=24, seed=0, step=0, eos_token_id=EOS, pad_token_id=PAD)
    with monkeypatch.context() as m:
        m.setattr(generation, "placeholder_ids", lambda model: [])
        unmasked = generation.generate_for_group(model, mesh, PROMPTS, **kw)
    assert any(t in placeholders for c in unmasked for t in c), "this rollout must reach a placeholder unmasked"
    for top_k, checked in ((0, 2), (3, 1)):  # the manual sampler (a full forward per token) on the first prompts
        got = generation.generate_for_group(model, mesh, PROMPTS, top_k=top_k, **kw)
        assert not any(t in placeholders for c in got for t in c)
        ref = [manual_sample(model, p, generation.row_seed(0, 0, 0, i, k), 24, EOS, top_k=top_k, banned=placeholders)
               for i, p in enumerate(PROMPTS[:checked]) for k in range(4)]
        assert got[:len(ref)] == ref


# ----------------------------------------------------------------------------- multi-rank
def _sp_world(fsdp: bool, n_prompts: int) -> dict:
    """SP=world generation of n_prompts prompts; fsdp: the model FSDP2-sharded over the world first."""
    from seqpar import init_mesh
    from seqpar.hf import apply_sequence_parallel
    from seqpar.hf.generation import generate_for_group, is_sharded

    world = torch.distributed.get_world_size()
    mesh = init_mesh(world)
    model = apply_sequence_parallel(peaked_model(), mesh)
    if fsdp:
        from seqpar.memory.sharding import shard_over_world

        shard_over_world(model, "cpu", world, None)
        assert is_sharded(model)
    comps = generate_for_group(model, mesh, PROMPTS[:n_prompts], num_generations=2, max_new_tokens=10,
                               temperature=0.9, seed=1, step=3, eos_token_id=EOS, pad_token_id=PAD)
    return {"comps": comps}


def _reference(n_prompts: int) -> list[list[int]]:
    from seqpar.hf.generation import row_seed

    model = peaked_model().eval()
    return [manual_sample(model, p, row_seed(1, 3, 0, i, k), 10, EOS, 0.9)
            for i, p in enumerate(PROMPTS[:n_prompts]) for k in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("world, fsdp, n_prompts", [(3, False, 4), (2, True, 4), (2, True, 1)])
def test_rollout_shared_over_sp_group_matches_one_process(world, fsdp, n_prompts):
    """Every SP rank samples its share (P=3: shares of 1/1/2 prompts); FSDP2: every rank joins every forward
    (n_prompts=1: one rank decodes a dummy row), no hang (spawn timeout); completions == the reference."""
    res = run_distributed(_sp_world, world, fsdp, n_prompts, timeout=300)
    ref = _reference(n_prompts)
    for r in res:
        assert r["comps"] == ref


# ----------------------------------------------------------------------------- seqpar train, stage grpo + FSDP2
def _train(cfg_dict: dict) -> dict:
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    res = train(config_from_dict(cfg_dict))
    return {"losses": res.losses, "state": res.final_state_path}


@pytest.mark.slow
def test_seqpar_train_grpo_fsdp2_matches_unsharded(tmp_path):
    """`stage: grpo` with `fsdp: true` (refused before): SP=2 over a world of 2, FSDP2 over both ranks, two
    steps (step 2 samples from the updated, sharded policy) vs the same run without FSDP: losses and final
    parameters within 1e-5 (fp32); the completions are the same draws, so any generation mismatch shows."""
    import json

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in
                            [("alpha beta", "a"), ("gamma", "m"), ("delta epsilon zeta", "z"), ("eta", "t")]))

    def cfg(out: str, fsdp: bool) -> dict:
        return {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2}},
                "dataset": {"path": str(data), "max_length": 40}, "stage": "grpo", "sequence_parallel": 2,
                "micro_batch_size": 2, "grad_accum": 2, "max_steps": 2, "seed": 3, "output_dir": str(tmp_path / out),
                "optimizer": {"name": "sgd", "lr": 0.5}, "checkpoint": {"save_final": True}, "progress": False,
                "export": {"final": False}, "memory": {"measure": False}, "fsdp": fsdp, "precision": "fp32",
                "grpo": {"reward_funcs": ["seqpar:length", "seqpar:contains"], "num_generations": 2,
                         "max_prompt_length": 24, "max_completion_length": 12, "temperature": 0.8, "beta": 0.04}}

    sharded = run_distributed(_train, 2, cfg("fsdp", True), timeout=400)[0]
    plain = run_distributed(_train, 2, cfg("plain", False), timeout=400)[0]
    assert len(sharded["losses"]) == 2
    assert max(abs(a - b) for a, b in zip(sharded["losses"], plain["losses"])) <= 1e-5
    s1, s2 = torch.load(sharded["state"]), torch.load(plain["state"])
    assert s1.keys() == s2.keys()
    assert max(float((s1[k].float() - s2[k].float()).abs().max()) for k in s1) <= 1e-5


def test_grpo_top_k_reaches_the_sampler(monkeypatch, tmp_path):
    """`grpo.top_k` (a key since the placeholder hint named it) goes to generate_for_group, as top_p does."""
    import seqpar.train.grpo.engine as engine
    import seqpar.train.grpo.rollout as rollout
    from seqpar import init_mesh
    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prompts import PromptRow
    from seqpar.train.model.tokenizers import ByteTokenizer

    seen = {}

    def fake(model, mesh, prompts, **kw):
        seen.update(kw)
        raise SeqParError("sampled")

    monkeypatch.setattr(engine, "generate_for_group", fake)  # the transformers engine's sampler
    cfg = config_from_dict({"model": {"name": "tiny:llama"}, "dataset": {"path": "p.jsonl", "max_length": 512},
                            "stage": "grpo", "micro_batch_size": 4, "output_dir": str(tmp_path),
                            "grpo": {"reward_funcs": ["seqpar:length"], "top_k": 5, "top_p": 0.9}})
    r = rollout.GRPORollout(cfg, init_mesh(1), ByteTokenizer(), [], None)
    with pytest.raises(SeqParError, match="sampled"):
        r.rollout(None, [PromptRow("p", [1, 2])], 0)
    assert (seen["top_k"], seen["top_p"], seen["temperature"]) == (5, 0.9, 1.0), seen
