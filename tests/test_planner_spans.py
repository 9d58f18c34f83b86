"""The planner prices attention spans: sliding windows (Gemma 3, gpt-oss), chunks (Llama 4), MLA's head dims and
sinks. A windowed layer's attention FLOPs are the closed form sum over queries of min(i + 1, w) keys, per ring rank,
and stop growing per token past the window; its saved bytes per token do not depend on the length."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from seqpar.attention.costs import flops_per_rank
from seqpar.planner.collectives import step_collectives
from seqpar.planner.layer import (
    activation_bytes_per_token,
    kept_attention_bytes,
    layer_bytes_per_token,
    ring_rows_factor,
)
from seqpar.planner.memory import Features, Layout, Workload, estimate_memory
from seqpar.planner.model import load_model_facts
from seqpar.planner.spans import FULL, Span, span_pairs_per_rank, steps_with_work, visible_pairs
from seqpar.planner.time import attention_flops, step_flops

K = 1024
# The published Gemma 3 27B text config's shape (window 1024, every 6th layer global) and gpt-oss-20b's attention
# (window 128 on alternate layers, sinks; one expert here: the planner does not model gpt-oss's MoE).
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
          "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208,
          "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
          "query_pre_attn_scalar": 168, "tie_word_embeddings": True}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
           "sliding_window": 128, "max_position_embeddings": 131072, "attention_bias": True,
           "num_local_experts": 1, "num_experts_per_tok": 1,
           "layer_types": ["sliding_attention", "full_attention"] * 12}


_LOADED: dict[str, object] = {}


def _facts(tmp_path, name: str, cfg: dict):
    """The planner's facts of a config (loaded once per test session: building the meta model takes a second)."""
    key = json.dumps(cfg, sort_keys=True)
    if key not in _LOADED:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        _LOADED[key] = load_model_facts(str(path))
    return _LOADED[key]


def _brute(q0: int, q1: int, k0: int, k1: int, span: Span) -> int:
    ok = {"full": lambda i, j: True, "sliding": lambda i, j: i - j < span.size,
          "chunked": lambda i, j: i // span.size == j // span.size}[span.kind]
    return sum(1 for i in range(q0, q1) for j in range(k0, min(k1, i + 1)) if ok(i, j))


def _sum_min(a: int, b: int, w: int) -> int:
    """sum of min(i + 1, w) for i in [a, b): the keys a query at position i sees in a window of w."""
    below = max(0, min(b, w - 1) - a)  # queries i < w - 1 see i + 1 keys
    lo = a + 1
    return (lo + lo + below - 1) * below // 2 + (b - a - below) * w


def test_visible_pairs_against_brute_force():
    import random

    rng = random.Random(0)
    for _ in range(600):
        q0, k0 = rng.randrange(40), rng.randrange(60)
        q1, k1 = q0 + rng.randrange(30), k0 + rng.randrange(30)
        span = rng.choice([FULL, Span("sliding", rng.randint(1, 20)), Span("chunked", rng.randint(1, 20))])
        assert visible_pairs(q0, q1, k0, k1, span) == _brute(q0, q1, k0, k1, span), (q0, q1, k0, k1, span)


@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8])
def test_full_span_is_the_ring_piece_plan(ring):
    """Full attention: the same count as the ring's own piece plan (attention.costs.flops_per_rank, 4 d per pair)."""
    for layout in ("zigzag", "contiguous"):
        seq = 96 * ring
        assert [4 * p for p in span_pairs_per_rank(seq, ring, layout, FULL)] == flops_per_rank(seq, ring, layout, 1, 1)
    assert ring_rows_factor(ring) == {1: 1.0, 2: 2.5, 3: 3.5, 4: 4.5, 8: 8.5}[ring]


@pytest.mark.parametrize("ring", [1, 2, 3, 4])
def test_closed_form_is_the_rings_plan(ring):
    """The closed form counts what seqpar's ring plans for a window (attention.pieces.plan_pieces with `window`) and
    for chunks (run as document boundaries), pair for pair on every ring rank, and the ring steps with any piece."""
    from seqpar.attention.pieces import plan_pieces
    from seqpar.attention.pieces import visible_pairs as piece_pairs
    from seqpar.layout import ring_segments
    from seqpar.planner.spans import engine_args

    seq = 1536 * ring
    segs = [ring_segments(seq, ring, r, "zigzag") for r in range(ring)]
    for span in (Span("sliding", 1), Span("sliding", 100), Span("sliding", 700), Span("sliding", 5000),
                 Span("chunked", 256), Span("chunked", 1000), FULL):
        bounds, window = engine_args(seq, span)
        plans = [[plan_pieces(segs[me], segs[j], True, bounds, window) for j in range(ring)] for me in range(ring)]
        assert span_pairs_per_rank(seq, ring, "zigzag", span) == [
            sum(piece_pairs(p) for row in plans[me] for p in row) for me in range(ring)], span
        assert steps_with_work(seq, ring, "zigzag", span) == max(sum(1 for row in rank if row) for rank in plans)


@pytest.mark.parametrize("ring", [1, 2, 4, 8])
def test_window_flops_closed_form_and_flat_past_the_window(tmp_path, ring):
    """Gemma 3 and gpt-oss shaped: a local layer's forward FLOPs on the busiest rank equal 4 d H_q x the closed form
    over that rank's zigzag segments, and per token they do not grow from 64K to 128K (global layers' double)."""
    for name, cfg in (("gemma3", GEMMA3), ("gpt_oss", GPT_OSS)):
        m = _facts(tmp_path, name, cfg)
        w = cfg["sliding_window"]
        local = Span("sliding", w)
        assert m.attention_spans() == ({local: 52, FULL: 10} if name == "gemma3" else {local: 12, FULL: 12})
        per_token = {}
        for s in (64 * K, 128 * K):
            wl, lay = Workload(s), Layout(1, ring, 1)
            c = s // (2 * ring)
            segs = [[(r * c, (r + 1) * c), ((2 * ring - 1 - r) * c, (2 * ring - r) * c)] for r in range(ring)]
            closed = max(sum(_sum_min(a, b, w) for a, b in rank) for rank in segs)  # the busiest ring rank
            assert attention_flops(m, wl, lay, local) == 4 * m.heads * m.head_dim * closed
            per_token[s] = (attention_flops(m, wl, lay, local) * ring / s, attention_flops(m, wl, lay, FULL) * ring / s)
        (loc64, full64), (loc128, full128) = per_token[64 * K], per_token[128 * K]
        assert loc128 == pytest.approx(loc64, rel=2 * w / (64 * K)) and loc128 <= 4 * m.heads * m.head_dim * w
        assert full128 == pytest.approx(2 * full64, rel=1e-3)
        if ring > 1:  # only the own block and its zigzag neighbours are in reach
            assert steps_with_work(128 * K, ring, "zigzag", local) == min(ring, 3)


LLAMA4 = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 512, "num_local_experts": 1, "max_position_embeddings": 256 * K, "attention_chunk_size": 8192}


def test_chunked_span_flops(tmp_path):
    """Llama 4's chunked layers (layer_types derived from attention_chunk_size: three chunked, one global): causal
    inside each chunk, sum over chunks of c (c + 1) / 2 pairs, on one rank and over a zigzag ring."""
    m = _facts(tmp_path, "llama4", LLAMA4)
    assert m.attention_spans() == {Span("chunked", 8192): 3, FULL: 1}
    c, s = 8192, 128 * K
    pairs = s // c * c * (c + 1) // 2
    assert attention_flops(m, Workload(s), Layout(1, 1, 1), Span("chunked", c)) == 4 * 4 * 16 * pairs
    assert span_pairs_per_rank(s, 1, "contiguous", Span("chunked", c)) == [pairs]
    assert sum(span_pairs_per_rank(s, 4, "zigzag", Span("chunked", c))) == pairs


def test_mixed_model_between_all_local_and_all_global(tmp_path):
    """Gemma 3's 52 local + 10 global layers: step attention FLOPs between the same model all local and all global,
    and equal to 52 local + 10 global layers' sum; the ring's step time falls with them."""
    mixed = _facts(tmp_path, "mixed", GEMMA3)
    local = _facts(tmp_path, "local", {**GEMMA3, "layer_types": ["sliding_attention"] * 62})
    full = _facts(tmp_path, "full", {**GEMMA3, "layer_types": ["full_attention"] * 62})
    wl, lay, f = Workload(128 * K), Layout(2, 4, 1), Features(activation_checkpointing=True, fsdp=True)
    att = {n: step_flops(m, wl, lay, f)[1] for n, m in (("mixed", mixed), ("local", local), ("full", full))}
    assert att["local"] < att["mixed"] < att["full"]
    assert att["mixed"] == pytest.approx((52 * att["local"] + 10 * att["full"]) / 62, rel=1e-12)
    assert att["full"] / att["local"] > 50  # 128K / 1024 over two: the window's saving
    assert step_flops(mixed, wl, lay, f)[0] == step_flops(full, wl, lay, f)[0]  # the matmuls are the same
    # the ring still rotates every K/V block: a windowed model's collectives are a global one's
    assert step_collectives(mixed, wl, lay, f) == step_collectives(full, wl, lay, f)


def test_window_memory_is_linear_in_the_length(tmp_path):
    """A windowed layer keeps per token what a global one keeps (q, k, v, out, lse: no S^2 term): the activations
    double from 64K to 128K; memory.keep_attention keeps no output for the ring steps a window skips."""
    m = _facts(tmp_path, "gemma3", GEMMA3)
    full = _facts(tmp_path, "full", {**GEMMA3, "layer_types": ["full_attention"] * 62})
    for lay in (Layout(1, 1, 1), Layout(4, 1, 1), Layout(1, 4, 1), Layout(2, 4, 1)):
        wl = Workload(64 * K)
        assert layer_bytes_per_token(m, wl, lay.ulysses, ring=lay.ring) == layer_bytes_per_token(
            full, wl, lay.ulysses, ring=lay.ring)
        for feats in (Features(), Features(activation_checkpointing=True, keep_attention=True, fused_loss=True)):
            per_token = [activation_bytes_per_token(m, replace(wl, seq_len=s), lay.ulysses, feats, lay.ring)
                         for s in (64 * K, 128 * K)]
            # per token: the same at both lengths (keep_attention: a window's calls cover w rows of a neighbour's
            # block, a smaller share of a longer block)
            assert per_token[0] == per_token[1] > 0 if not feats.keep_attention else per_token[0] >= per_token[1] > 0
            lora = replace(wl, finetuning="lora")  # the activations' peak (not the optimizer's)
            peaks = [estimate_memory(m, replace(lora, seq_len=s), lay, feats) for s in (64 * K, 128 * K)]
            assert peaks[0].phase != "optimizer" and peaks[0].total < peaks[1].total <= 2 * peaks[0].total
    kept_local = kept_attention_bytes(m, 2, 1, 8, 128 * K)
    assert kept_local < kept_attention_bytes(full, 2, 1, 8, 128 * K)
    assert kept_local <= kept_attention_bytes(m, 2, 1, 8, 64 * K)  # the skipped steps do not grow with S


MINICPM3 = {"model_type": "minicpm3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
            "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000, "q_lora_rank": 96,
            "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 24,
            "max_position_embeddings": 4096, "tie_word_embeddings": True}


@pytest.mark.parametrize("q_rank", [96, None])
def test_mla_prices_k_and_v_apart(tmp_path, q_rank):
    """MLA (MiniCPM3 / DeepSeek shaped): q / k head dim 48 = nope 32 + rope 16, v head dim 24. The parameter count
    equals the model transformers builds; o_proj's input and LoRA shapes use v's dim, the kernels' q, k, v and output
    q / k's (v padded); exchanges at the padded width."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**MINICPM3, "q_lora_rank": q_rank}
    m = _facts(tmp_path, f"mla{q_rank}", cfg)
    assert (m.head_dim, m.v_head, m.o_dim, m.q_dim, m.kv_dim) == (48, 24, 8 * 24, 8 * 48, 8 * 48)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **{
            k: v for k, v in cfg.items() if k != "model_type"}))
    assert m.num_params() == sum(p.numel() for p in model.parameters())
    names = {n.rsplit(".", 1)[0].rsplit(".", 1)[-1]: p.shape for n, p in model.named_parameters() if "layers.0." in n}
    shapes = m._lora_shapes()
    for proj in ("o_proj", "kv_a_proj_with_mqa", "kv_b_proj", *(("q_a_proj", "q_b_proj") if q_rank else ("q_proj",))):
        assert tuple(names[proj])[::-1] == shapes[proj], proj
    same = replace(m, v_head_dim=None)  # v at q / k's dim: only o_proj's input differs among the saved tensors
    wl = Workload(4096)
    assert layer_bytes_per_token(same, wl, 1) - layer_bytes_per_token(m, wl, 1) == 2 * 8 * (48 - 24)
    assert layer_bytes_per_token(same, wl, 2) - layer_bytes_per_token(m, wl, 2) == 2 * 8 * (48 - 24)


def test_plan_prints_the_spans(tmp_path, capsys):
    """`seqpar plan` on a windowed model: one line of layers per span and each span's FLOPs per layer at the
    recommended mesh; gpt-oss's sinks and an MLA model's dims are named."""
    from seqpar.cli.main import main

    for name, cfg in (("gemma3", GEMMA3), ("gpt_oss", GPT_OSS)):
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    (tmp_path / "mla.json").write_text(json.dumps(MINICPM3))
    argv = ["plan", "--gpus", "8", "--gpu", "h200", "--seq-len", str(128 * K), "--ring-degree", "2", "--model"]
    assert main([*argv, str(tmp_path / "gemma3.json")]) == 0
    out = capsys.readouterr().out
    assert "attention: 52 sliding window 1024, 10 global layers; at 131072 tokens" in out, out
    assert "ring steps with work 2 of 2" in out and "K/V still travel the whole ring" in out, out
    assert main([*argv, str(tmp_path / "gemma3.json"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    best = got["candidates"][got["recommended"]]
    lay = Layout(best["ulysses_degree"], best["ring_degree"], best["dp_size"])
    wl = Workload(best["seq_len"])
    m = _facts(tmp_path, "gemma3", GEMMA3)
    assert got["attention_spans"] == [
        {"span": "sliding", "size": 1024, "layers": 52, "ring_steps_with_work": 2,
         "fwd_flops_per_layer": attention_flops(m, wl, lay, Span("sliding", 1024))},
        {"span": "full", "size": 0, "layers": 10, "ring_steps_with_work": 2,
         "fwd_flops_per_layer": attention_flops(m, wl, lay, FULL)}]
    assert main([*argv, str(tmp_path / "gpt_oss.json")]) == 0
    out = capsys.readouterr().out
    assert "12 sliding window 128, 12 global layers" in out and "sinks, one logit per q head (64" in out, out
    small = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512,
             "sliding_window": 64, "max_position_embeddings": 4096}
    (tmp_path / "small.json").write_text(json.dumps(small))
    assert main(["plan", "--gpus", "2", "--sample-rows", "64", "--lengths", "0.5:128-256,0.5:1024", "--model",
                 str(tmp_path / "small.json")]) == 0
    assert "note: --lengths prices every attention layer as full attention" in capsys.readouterr().out
    assert main(["plan", "--gpus", "8", "--seq-len", "4096", "--model", str(tmp_path / "mla.json")]) == 0
    assert "MLA, q/k head dim 48, v head dim 24" in capsys.readouterr().out
