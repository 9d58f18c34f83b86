"""seqpar plan for mixture-of-experts MLPs (planner.moe): Qwen3-Next / Qwen3.5-MoE's sparse MoE block.

Checked: the parameter count equals the tiny HF model's (every expert, the router, the shared expert and its gate);
the per-token saved tensors of the MoE block (transformers' default grouped_mm experts) equal MemTracker's on the
stock block within 0.5%; the time model multiplies by the top-k experts' weights only and adds no collective; what
the planner does not model (tiled MLP / layer, LoRA, the router's aux loss, MoE models of other architectures,
another experts implementation) is refused. The whole memory model is validated against the meter by the hybrid
grid's Qwen3-Next rows (tests/test_planner_hybrid.py, docs/cpu_results/).
"""

from __future__ import annotations

import json

import pytest

from seqpar.errors import SeqParError
from seqpar.planner.collectives import passes, step_collectives
from seqpar.planner.gpus import make_cluster
from seqpar.planner.model import load_model_facts
from seqpar.planner.search import Request, plan
from seqpar.planner.time import step_flops
from seqpar.planner.workload import Features, Layout, Workload


def _config(tmp_path, arch: str, **kw) -> str:
    from seqpar.hf.models import tiny_config

    path = tmp_path / f"{arch}.json"
    path.write_text(json.dumps(tiny_config(arch, 4, 2, vocab_size=259, **kw).to_dict()))
    return str(path)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_moe_params_equal_the_model(tmp_path, arch):
    from seqpar.hf.models import tiny_model

    m = load_model_facts(_config(tmp_path, arch))
    assert m.moe is not None and (m.moe.experts, m.moe.top_k) == (4, 2)
    model = tiny_model(arch, 4, 2, vocab_size=259)
    assert m.num_params() == sum(p.numel() for p in model.parameters())


def test_moe_saved_tensors_match_memtracker():
    """The stock Qwen3-Next MoE block (fp32, 256 tokens, grouped_mm): what it keeps after forward, per token, is
    planner.moe's count within 0.5%; the temporaries at its backward's peak are planner.moe's moment's within 1%."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from seqpar.hf.models import tiny_model

    m = load_model_facts("tiny:qwen3_next", {"head_dim": 16})
    torch.manual_seed(0)
    model = tiny_model("qwen3_next", 4, 2, vocab_size=259, head_dim=16)
    assert model.config._experts_implementation == "grouped_mm"
    block, seq = model.model.layers[0].mlp, 256
    x = torch.randn(1, seq, model.config.hidden_size)
    mt = MemTracker()
    mt.track_external(block)
    with mt:
        xr = x.clone().requires_grad_()
        y = block(xr)
        y.backward(torch.ones_like(y))
    snaps = {str(k.value): v[-1] if isinstance(v, list) else v for k, v in mt.memory_tracking[block].snapshots.items()}
    total = {k: next(iter(v.values()))["Total"] for k, v in snaps.items()}
    saved = (total["Post-Forward"] - total["Pre-Forward"] - 4 * m.hidden * seq) / seq  # less the block's output
    assert m.moe.saved_bytes(4, m.hidden) == pytest.approx(saved, rel=0.005)
    peak = next(iter(snaps["Peak-Backward"].values()))
    temp = next(v for k, v in peak.items() if getattr(k, "value", k) == "Temp")
    assert m.moe.backward_temp(4, m.hidden) * seq == pytest.approx(temp, rel=0.01)  # the MoE moment's temporaries


def test_moe_time_counts_the_active_experts(tmp_path):
    """FLOPs: the top-k experts' (and the shared expert's) per token, not every expert's; no expert-parallel
    collective (the layer's collectives are those of the same model with a dense MLP)."""
    moe = load_model_facts("tiny:qwen3_next", {"num_experts": 64, "num_experts_per_tok": 2})
    wl, lay, feats = Workload(4096), Layout(2, 2, 1), Features()
    h, i, s = moe.hidden, moe.moe.intermediate, moe.moe.shared_intermediate
    assert moe.mlp_params() == 64 * 3 * h * i + 64 * h + 3 * h * s + h
    assert moe.active_layer_params() == moe.layer_params() - moe.mlp_params() + 2 * 3 * h * i + 64 * h + 3 * h * s + h
    few = load_model_facts("tiny:qwen3_next", {"num_experts": 4, "num_experts_per_tok": 2})
    fwd_bwd, fwd_only = passes(wl, feats)
    assert step_flops(moe, wl, lay, feats)[0] - step_flops(few, wl, lay, feats)[0] == pytest.approx(
        2 * wl.seq_len / lay.sp * moe.layers * 60 * h * (fwd_bwd + fwd_only + 2), rel=1e-9)  # 60 more router columns
    seq = {c.what: c for c in step_collectives(moe, wl, lay, feats)}
    dense = {c.what: c for c in step_collectives(few, wl, lay, feats)}
    assert seq.keys() == dense.keys()
    assert all(seq[k] == dense[k] for k in seq if k.startswith(("ulysses", "ring", "state", "halo")))
    cands, best = plan(moe, make_cluster(8, 8, "h100"), Request(workload=wl))
    assert best is not None and cands[best].fits


def test_moe_what_is_not_modelled_is_refused(tmp_path):
    m = load_model_facts("tiny:qwen3_next")
    cl, wl = make_cluster(8, 8, "h100"), Workload(4096)
    for req in (Request(workload=wl, tiled_mlp=True), Request(workload=wl, tiled_layer=True),
                Request(workload=Workload(4096, finetuning="lora"))):
        with pytest.raises(SeqParError, match="mixture-of-experts MLPs"):
            plan(m, cl, req)
    with pytest.raises(SeqParError, match="set config.output_router_logits = False"):
        load_model_facts(_config(tmp_path, "qwen3_next", output_router_logits=True))
    with pytest.raises(SeqParError, match="mlp_only_layers"):
        load_model_facts(_config(tmp_path, "qwen3_next", mlp_only_layers=[0]))
    with pytest.raises(SeqParError, match="mixture-of-experts"):  # Granite 4's MoE block: not this one
        load_model_facts("tiny:granitemoehybrid")
    cfg = json.loads(open(_config(tmp_path, "qwen3_next")).read())
    path = tmp_path / "eager.json"
    path.write_text(json.dumps({**cfg, "experts_implementation": "eager"}))
    with pytest.raises(SeqParError, match="grouped_mm"):
        load_model_facts(str(path))


def test_qwen3_next_shaped_config_plans(tmp_path):
    """A Qwen3-Next-80B-A3B-shaped config.json (illustrative numbers): no `layer_types`, so its kinds come from
    `full_attention_interval` as transformers builds them (3 Gated DeltaNet layers per attention layer); 512
    experts, top-10: about 80B parameters, 3.25B active in the decoder; 256K tokens on 16 GPUs plan."""
    cfg = {"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120, "vocab_size": 151936,
           "max_position_embeddings": 262144, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
           "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_model_facts(str(path))
    assert (m.linear_layers, m.attn_layers, m.linear_index[:4]) == (36, 12, (0, 1, 2, 4))
    assert 79e9 < m.num_params() < 81e9 and 3e9 < m.layers * m.active_layer_params() < 3.5e9
    cands, best = plan(m, make_cluster(16, 8, "h200"), Request(workload=Workload(1 << 18)))
    assert best is not None and cands[best].fits
