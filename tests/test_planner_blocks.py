"""seqpar plan for block-per-mixer decoders (Nemotron-H): each block holds one mixer (Mamba2 or softmax attention)
or one dense MLP (planner.model's `mlp_index`).

Checked: the parameter count equals the tiny HF model's, from `layers_block_type` and from the published
config.json's `hybrid_override_pattern`; a Nemotron-H-shaped config (illustrative numbers) plans, its MLP blocks
carry no sequence collective (Ulysses / ring traffic of its attention blocks only, state passing of its Mamba2
blocks only); MoE blocks and the tiled MLP / layer (which seqpar refuses on these blocks) are refused. The memory
model is validated against the meter by the hybrid grid (tests/test_planner_hybrid.py, docs/cpu_results/).
"""

from __future__ import annotations

import json

import pytest

from seqpar.errors import SeqParError
from seqpar.planner.collectives import passes, step_collectives
from seqpar.planner.gpus import make_cluster
from seqpar.planner.model import load_model_facts
from seqpar.planner.search import Request, plan
from seqpar.planner.workload import Features, Layout, Workload

BLOCKS = ["linear_attention", "mlp", "full_attention", "mlp"]

# A Nemotron-H-shaped decoder (illustrative numbers, not a published checkpoint's): 6 x "M-M-M-M*-".
PATTERN = "M-M-M-M*-" * 6
NEMOTRON_LIKE = {
    "model_type": "nemotron_h", "hidden_size": 4096, "hybrid_override_pattern": PATTERN, "num_hidden_layers": 54,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
    "vocab_size": 131072, "max_position_embeddings": 1 << 20, "mamba_num_heads": 128, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "tie_word_embeddings": False,
}


def _write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("from_pattern", [False, True])
def test_nemotron_h_params_equal_the_model(tmp_path, from_pattern):
    from seqpar.hf.models import tiny_config, tiny_model

    cfg = {k: v for k, v in tiny_config("nemotron_h", 4, 2, vocab_size=259, head_dim=8,
                                        layers_block_type=BLOCKS).to_dict().items() if k != "time_step_limit"}
    if from_pattern:  # the published config.json form
        cfg.pop("layers_block_type")
        cfg.pop("layer_types", None)
        cfg["hybrid_override_pattern"] = "M-*-"
    m = load_model_facts(_write(tmp_path, cfg))
    assert (m.linear_layers, m.attn_layers, m.mlp_index, m.layers) == (1, 1, (1, 3), 4)
    assert m.blocks and not m.rope
    model = tiny_model("nemotron_h", 4, 2, vocab_size=259, head_dim=8, layers_block_type=BLOCKS)
    assert m.num_params() == sum(p.numel() for p in model.parameters())


def test_nemotron_h_blocks_plan_with_their_own_collectives(tmp_path):
    m = load_model_facts(_write(tmp_path, NEMOTRON_LIKE))
    assert (m.linear_layers, m.attn_layers, len(m.mlp_index)) == (24, 6, 24)
    h, i = 4096, 21504
    assert m.block_params("mlp") == 2 * h * i + h  # relu2: up and down, no gate
    feats, seq = Features(activation_checkpointing=True), 1 << 17
    wl = Workload(seq)
    got = {c.what: c for c in step_collectives(m, wl, Layout(8, 2, 1), feats)}
    fwd_bwd, fwd_only = passes(wl, feats)
    assert got["ulysses"].calls == 2 * 6 * (fwd_bwd + fwd_only + 1)  # the 6 attention blocks only
    assert got["ulysses_recurrent"].calls == 2 * 24 * (fwd_bwd + fwd_only + 1)  # the 24 Mamba2 blocks only
    assert got["ring"].calls == 6 * (2 * 1 * 2 + 2 * 1 + 1)
    assert got["state"].calls == 24 * 3 * 2
    cands, best = plan(m, make_cluster(16, 8, "h100"), Request(workload=wl))
    assert best is not None and cands[best].fits
    for kw in ({"tiled_mlp": True}, {"tiled_layer": True}):
        with pytest.raises(SeqParError, match="one mixer or one MLP per block"):
            plan(m, make_cluster(16, 8, "h100"), Request(workload=wl, **kw))


def test_nemotron_h_moe_blocks_are_refused(tmp_path):
    with pytest.raises(SeqParError, match="mixture-of-experts"):
        load_model_facts(_write(tmp_path, {**NEMOTRON_LIKE, "hybrid_override_pattern": "M-M*E" * 9}))
    with pytest.raises(SeqParError, match="mixture-of-experts"):
        load_model_facts("tiny:nemotron_h")  # its default blocks include a 4-expert MoE
