"""seqpar plan: formulas (hand-checked), bad inputs, --json schema, and predicted vs MemTracker-measured memory."""

from __future__ import annotations

import json

import pytest

from seqpar.attention.costs import ring_theory, ulysses_theory
from seqpar.cli.main import main
from seqpar.errors import SeqParError
from seqpar.planner import Features, Layout, Workload, estimate_memory, load_model_facts, make_cluster
from seqpar.planner.memory import activation_bytes_per_token, final_norm_bytes, layer_bytes_per_token, loss_bytes
from seqpar.planner.search import Request, plan
from seqpar.planner.time import attention_flops, comm_bytes_per_layer

# The validation grid's base model: h=64 (4 q heads x 16), 2 kv heads, I=128, V=512, 2 layers.
TINY = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2, "intermediate_size": 128,
        "vocab_size": 512}


def tiny(arch: str = "llama", **kw):
    return load_model_facts(f"tiny:{arch}", {**TINY, **kw})


def test_param_counts_match_hf_and_published():
    from seqpar.hf import tiny_model

    for arch in ("llama", "qwen2", "qwen3"):
        model = tiny_model(arch, **{k: v for k, v in TINY.items() if k not in ("num_heads", "num_kv_heads")})
        assert tiny(arch).num_params() == sum(p.numel() for p in model.parameters()), arch
    assert load_model_facts("llama-3.1-8b").num_params() == 8_030_261_248  # published count
    assert load_model_facts("smollm2").num_params() == 134_515_008
    # The sizes the model cards publish (billions, rounded as they are printed there).
    published = {"llama-3.1-70b": 70.6, "qwen2.5-7b": 7.61, "qwen2.5-14b": 14.7, "qwen2.5-72b": 72.7,
                 "qwen3-4b": 4.02, "qwen3-32b": 32.8, "qwen3-8b": 8.19, "qwen2.5-3b": 3.09}
    for name, billions in published.items():
        assert abs(load_model_facts(name).num_params() / 1e9 - billions) / billions < 0.005, name
    q3 = load_model_facts("Qwen/Qwen3-4B")
    assert (q3.tied, q3.qk_norm, q3.heads, q3.kv_heads, q3.head_dim) == (True, True, 32, 8, 128)


def test_layer_activation_bytes_hand_count():
    m = tiny()
    # fp32 full FT, per token: 2 norms x (rsqrt 1 + fp32 input 64 + normalised 64 + output 64) = 386,
    # q 64 + k 32 + v 32 + out 64 + lse 4 = 196, MLP gate/silu/up/product 4 x 128 = 512 -> 1094 floats.
    assert layer_bytes_per_token(m, Workload(256, precision="fp32"), 1) == 1094 * 4
    # Ulysses u=2 (identity head plan): head-space q/k/v/out 64+32+32+64 + lse 4 + o_proj input 64 = 260.
    assert layer_bytes_per_token(m, Workload(256, precision="fp32"), 2) == (1094 - 196 + 260) * 4
    # bf16: norms keep an fp32 input copy (4*64) + rsqrt (4) + two bf16 tensors (2*2*64) = 516 bytes each;
    # attention 2*(64+32+32+64) + 4*4 = 400; MLP 2*512 = 1024.
    assert layer_bytes_per_token(m, Workload(256, precision="bf16"), 1) == 2 * 516 + 400 + 1024
    # LoRA (q,k,v,o, r=8): norms keep no normalised x; the MLP input is not kept (frozen gate/up); no
    # silu*up (frozen down); + 4 adapters x r=8 outputs.
    lora = Workload(256, finetuning="lora", precision="fp32")
    assert layer_bytes_per_token(m, lora, 1) == (65 + 64) * 4 + 196 * 4 + 65 * 4 + 3 * 128 * 4 + 32 * 4
    # Qwen3 q/k norms: projection outputs (fp32) 64+32, rsqrt 4+2, normalised 64+32 -> 198 floats more.
    assert layer_bytes_per_token(tiny("qwen3"), Workload(256, precision="fp32"), 1) == (1094 + 198) * 4


def test_feature_terms():
    m, wl = tiny(), Workload(256, precision="bf16")
    none = activation_bytes_per_token(m, wl, 1, Features())
    ckpt = activation_bytes_per_token(m, wl, 1, Features(activation_checkpointing=True))
    # checkpointing keeps one bf16 layer input per layer instead of the layer's saved tensors
    assert none - ckpt == 2 * (layer_bytes_per_token(m, wl, 1) - 2 * 64)
    tiled = activation_bytes_per_token(m, wl, 1, Features(tiled_mlp=True))
    assert none - tiled == 2 * 2 * 4 * 128  # no [S, intermediate] tensor stays: 4 of them, bf16, 2 layers
    lay = Layout()
    loss = estimate_memory(m, Workload(256, precision="fp32"), lay, Features()).phases
    plain = Features()
    assert estimate_memory(m, Workload(256, precision="fp32"), lay, plain).loss_chunk == 12 * 512 * 256
    fused = estimate_memory(m, Workload(256, precision="fp32"), lay, Features(fused_loss=True, loss_chunk_tokens=32))
    assert fused.phases["loss_backward"] < loss["loss_backward"]


def test_fused_loss_chunk_counts_supervised_positions():
    # At log_softmax's backward one recomputed chunk holds its fp32 log-softmax, that gradient and the
    # logits' gradient: 12 V bytes per supervised position, whatever the weights' dtype; every supervised
    # position also has its int64 index and target and its NLL's fp32 gradient (20 B) and, once a second chunk
    # runs backward, the gradient of its hidden state (e h). DPO's micro-batch has 2 rows (chosen,
    # rejected); the prompt positions get no logits.
    m, lay = tiny(), Layout()
    n = 2 * (256 - 85)
    for prec, e in (("fp32", 4), ("bf16", 2)):
        dpo = Workload(256, stage="dpo", precision=prec, unsupervised_tokens=85)
        whole = estimate_memory(m, dpo, lay, Features(fused_loss=True))
        assert whole.phase == "loss_backward" and whole.loss_chunk == 12 * 512 * n + 20 * n
        chunked = Features(fused_loss=True, loss_chunk_tokens=32)
        assert loss_bytes(m, dpo, Features(fused_loss=True), 512) - loss_bytes(m, dpo, chunked, 512) == (
            12 * 512 * (n - 32) - e * m.hidden * n)
        # the loss moment is the larger of the loss's working set and the final norm's backward after it
        phases = estimate_memory(m, dpo, lay, chunked).phases
        assert phases["loss_backward"] - whole.phases["loss_backward"] == (
            max(loss_bytes(m, dpo, chunked, 512), final_norm_bytes(m, dpo, lay, chunked, 512)) - whole.loss_chunk)
    # without the fused loss every position has logits, supervised or not
    dpo = Workload(256, stage="dpo", precision="fp32", unsupervised_tokens=85)
    assert estimate_memory(m, dpo, lay, Features()).loss_chunk == 12 * 512 * 2 * 256


def test_tiled_mlp_with_one_tile_is_the_plain_mlp():
    # auto tiles = ceil(S_local / hidden): 64 local tokens per row at h=64 is one tile, which runs unchanged
    m, wl = tiny(), Workload(256, stage="dpo", precision="fp32")
    one = estimate_memory(m, wl, Layout(2, 2, 1), Features(tiled_mlp=True))
    assert one.total == estimate_memory(m, wl, Layout(2, 2, 1), Features()).total
    two = estimate_memory(m, wl, Layout(2, 1, 1), Features(tiled_mlp=True))
    assert two.phases["loss_backward"] < estimate_memory(m, wl, Layout(2, 1, 1), Features()).phases["loss_backward"]


def test_layer_backward_moment_against_memtracker_readings():
    # MemTracker's live bytes at the MLP product's backward (seqpar train's step, tiny model, fp32, S=256,
    # second step; read with a per-op probe on this build). Checkpointing, no FSDP: layer 0's backward
    # (the lm_head and layer 1 gradients exist, layer 1's input is freed). FSDP2 ring 2: also the
    # gathered layer and the previous layer's unsharded gradients in their reduce-scatter.
    m, wl = tiny(), Workload(256, precision="fp32", device="cpu")  # the CPU meter's readings
    ckpt = estimate_memory(m, wl, Layout(), Features(activation_checkpointing=True))
    assert ckpt.phases["layer_backward"] == pytest.approx(3474116, rel=1e-3)
    fsdp = estimate_memory(m, wl, Layout(1, 2, 1), Features(activation_checkpointing=True, fsdp=True))
    assert fsdp.phases["layer_backward"] == pytest.approx(2377540, rel=1e-3)
    assert fsdp.phase == "layer_backward" and fsdp.activations > 0 and fsdp.gradients > 0 and fsdp.comm_buffers > 0


def test_comm_and_flops_reuse_theory():
    m = tiny()
    wl = Workload(1024, precision="bf16")
    cb = comm_bytes_per_layer(m, wl, Layout(2, 2, 1))
    assert cb["ulysses"] == 2 * ulysses_theory(512, 1, 4, 2, 16, 2, 2)
    r = ring_theory(1024, 1, 2, 16, 2, 2)
    assert cb["ring"] == (r["fwd"] + r["bwd"]) // 2
    # Ulysses sends the heads ulysses.rank_heads gives (14q/2kv at P=4: 14 q and 4 kv replicas, no dummies),
    # in pure Ulysses and USP alike; USP's ring moves the 4 kv replicas
    m14 = tiny(num_heads=14, num_kv_heads=2, head_dim=8)
    assert comm_bytes_per_layer(m14, wl, Layout(4, 1, 1))["ulysses"] == 2 * ulysses_theory(1024, 1, 14, 4, 8, 4, 2)
    usp = comm_bytes_per_layer(m14, wl, Layout(4, 2, 1))
    assert usp["ulysses"] == 2 * ulysses_theory(512, 1, 14, 4, 8, 4, 2)
    r14 = ring_theory(1024, 1, 4, 8, 2, 2)
    assert usp["ring"] == (r14["fwd"] + r14["bwd"]) // 4
    # one rank, causal: 4 * H * D * S(S+1)/2
    assert attention_flops(m, wl, Layout()) == 4 * 4 * 16 * 1024 * 1025 / 2
    # zigzag ring of 4: every rank does a quarter of the (block-causal) work
    assert attention_flops(m, wl, Layout(1, 4, 1)) == pytest.approx(4 * 4 * 16 * 1024 * 1025 / 2 / 4, rel=0.01)


def test_dummy_heads_reported():
    m = load_model_facts("tiny:llama", {"num_heads": 14, "num_kv_heads": 2, "head_dim": 8})
    cands, _ = plan(m, make_cluster(4, 4, gpu_mem="80GiB"), Request(Workload(4096), ulysses_degree=4))
    assert cands and all(c.dummy_heads == 2 and c.kv_replication == 2 for c in cands)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv,msg", [
    (["--model", "tiny:llama", "--gpu", "b300", "--seq-len", "1024"], "unknown GPU 'b300'"),
    (["--model", "tiny:llama", "--gpu-mem", "0", "--seq-len", "1024"], "must be positive"),
    (["--model", "tiny:llama", "--gpus", "8", "--ulysses-degree", "8", "--seq-len", "9000"], "--max-position N"),
    (["--model", "tiny:llama", "--gpus", "8", "--ulysses-degree", "3", "--seq-len", "1024"], "must divide --gpus 8"),
    (["--model", "no/such-model", "--seq-len", "1024"], "neither a bundled model"),
    (["--model", "tiny:llama", "--gpus", "0", "--seq-len", "1024"], "--gpus must be a positive"),
    (["--model", "tiny:llama"], "give --seq-len"),
    (["--model", "tiny:llama", "--seq-len", "1024", "--prompt-len", "1024"], "--prompt-len must be"),
])
def test_bad_inputs(capsys, argv, msg):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and msg in err, err


def test_heads_that_cannot_be_split(tmp_path, capsys):
    cfg = {"hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 4,
           "intermediate_size": 128, "vocab_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, _, err = _run(capsys, "--model", str(tmp_path), "--seq-len", "1024")
    assert rc == 2 and "not a multiple of num_key_value_heads=4" in err
    with pytest.raises(SeqParError):
        load_model_facts(str(tmp_path / "config.json"))


def test_json_schema(capsys):
    rc, out, _ = _run(capsys, "--model", "llama-3.1-8b", "--gpus", "16", "--gpus-per-node", "8",
                      "--seq-len", "131072", "--json")
    d = json.loads(out)
    assert rc == 0 and set(d) >= {"candidates", "recommended"}
    c = d["candidates"][d["recommended"]]
    assert {"ulysses_degree", "ring_degree", "dp_size", "features", "memory_bytes", "step_time_s", "fits"} <= set(c)
    assert c["fits"] and c["ulysses_degree"] * c["ring_degree"] * c["dp_size"] == 16
    mem = c["memory_bytes"]
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    assert {"parameters", "gradients", "optimizer_state", "activations", "loss_chunk", "comm_buffers"} <= set(mem)
    rc, out, _ = _run(capsys, "--model", "qwen3-4b", "--gpus", "8", "--max-seq-len", "--json",
                      "--no-activation-checkpointing", "--fsdp")
    d = json.loads(out)
    best = d["candidates"][d["recommended"]]
    assert best["max_seq_len"] >= max(c["max_seq_len"] for c in d["candidates"]) > 0
    assert not best["features"]["activation_checkpointing"] and best["features"]["fsdp"]


def test_table_and_yaml(capsys, tmp_path):
    rc, out, _ = _run(capsys, "--model", "qwen2.5-7b", "--gpus", "8", "--seq-len", "65536")
    assert rc == 0 and "recommended #0" in out and "sequence_parallel:" in out
    import yaml

    from seqpar.train.config import config_from_dict

    cfg = yaml.safe_load(out.split("# seqpar train config (launch 8 processes", 1)[1].split("\n", 1)[1])
    assert config_from_dict(cfg).dataset.max_length == 65536  # the YAML is a valid seqpar train config
    assert cfg["model"]["name"] == "Qwen/Qwen2.5-7B"  # loadable by seqpar train (not the bundled shape's key)


def test_predicted_memory_matches_memtracker():
    """The fast subset of `seqpar plan --validate`: every row within TOLERANCE (2%) of the exact meter, without
    memory features and with all of them (checkpointing + fused loss + tiled MLP; ulysses 2 SFT and SP=1 DPO)."""
    from seqpar.planner.validate import FAST_GRID, TOLERANCE, format_rows, run_validation, with_features

    assert TOLERANCE == 0.02
    rows = run_validation(FAST_GRID + with_features([FAST_GRID[2], FAST_GRID[3]], ["all"]), timeout=540)
    assert all(abs(r["rel_err"]) <= TOLERANCE for r in rows), format_rows(rows)


# ----------------------------------------------------------------------------- time model
def test_collective_cost_and_attention_rate_by_hand():
    from dataclasses import replace

    cl = make_cluster(8, 8, "h100")
    # default: latency_s per call + bytes at the intra-node bandwidth (group fits the node)
    assert cl.collective_s("all_to_all", 4, 360e9, 8) == pytest.approx(4 * 2e-5 + 1.0)
    assert make_cluster(16, 8, "h100").collective_s("p2p", 1, 45e9, 2, 8) == pytest.approx(2e-5 + 1.0)
    measured = replace(cl, per_kind=(("p2p", 1e-3, 2.0),), attn_by_len=((1000, 1.0), (4000, 3.0)))
    assert measured.collective_s("p2p", 3, 2e9, 2) == pytest.approx(3e-3 + 1.0)
    assert measured.collective_s("all_reduce", 1, 0, 2) == pytest.approx(2e-5)  # kinds not measured: defaults
    assert measured.attention_tflops(2000) == pytest.approx(2.0)  # log-interpolated: 2000 is half-way 1000..4000
    assert measured.attention_tflops(10) == 1.0 and measured.attention_tflops(10**6) == 3.0
    assert cl.attention_tflops(5000) is None


def test_step_flops_by_hand():
    from seqpar.planner.time import step_flops

    m = tiny()
    W = m.layers * m.layer_params() + m.hidden * m.vocab  # every matmul weight (decoder + head)
    tokens = 1024 / 2
    lin, attn = step_flops(m, Workload(1024, precision="fp32"), Layout(2, 1, 1), Features())
    assert lin == 6 * tokens * W  # forward 2 + input grad 2 + weight grad 2
    a_fwd = attention_flops(m, Workload(1024), Layout(2, 1, 1)) * m.layers
    assert attn == pytest.approx(3.5 * a_fwd)
    ck, ck_attn = step_flops(m, Workload(1024), Layout(2, 1, 1), Features(activation_checkpointing=True))
    assert ck == 8 * tokens * W and ck_attn == pytest.approx(4.5 * a_fwd)  # the forward runs twice
    lora = Workload(1024, finetuning="lora")
    n_lora = m.lora_params(lora.lora_r, lora.lora_targets)
    assert step_flops(m, lora, Layout(2, 1, 1), Features())[0] == tokens * (4 * W + 2 * n_lora)
    dpo = Workload(1024, stage="dpo")  # 2 rows, plus the reference forward
    assert step_flops(m, dpo, Layout(2, 1, 1), Features())[0] == 2 * tokens * 8 * W


def test_time_model_overlap_rules():
    """GPU (overlap): a ring hop hides behind attention, FSDP behind compute; a CPU cluster exposes all."""
    from dataclasses import replace

    from seqpar.planner.time import estimate_time

    m = load_model_facts("llama-3.1-8b")
    wl = Workload(131072)
    gpu = make_cluster(8, 8, "h100")
    ring = estimate_time(m, wl, Layout(1, 8, 1), Features(fsdp=True), gpu)
    assert ring.parts["comm_ring"] == 0.0 and ring.parts["comm_fsdp"] == 0.0  # hidden at 128K
    cpu = replace(gpu, overlap=False)
    serial = estimate_time(m, wl, Layout(1, 8, 1), Features(fsdp=True), cpu)
    assert serial.exposed_comm_s > ring.exposed_comm_s
    assert serial.parts["comm_ring"] > 0 and serial.parts["comm_fsdp_gather"] > 0
    assert serial.step_s == pytest.approx(serial.compute_s + serial.exposed_comm_s)
    assert serial.compute_s == pytest.approx(sum(v for k, v in serial.parts.items() if not k.startswith("comm_")))


COUNT_CASES = [
    {"ulysses": 2}, {"ring": 2, "fsdp": True, "memory": {"fused_loss": False, "activation_checkpointing": True}},
    {"ulysses": 2, "stage": "dpo", "finetuning": "lora"}, {"dp": 2}, {"ulysses": 2, "stage": "dpo", "fsdp": True},
]


@pytest.mark.parametrize("kw", COUNT_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items() if k != "memory"))
def test_collective_counts_match_profiler(kw):
    """planner.collectives lists exactly the collective calls the trainer's step issues (torch.profiler)."""
    _check_counts(kw, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"ulysses": 2, "ring": 2, "fsdp": True}, {"ring": 4, "stage": "dpo"},
                                {"ulysses": 2, "dp": 2, "memory": {"fused_loss": False, "tiled_mlp": True}}])
def test_collective_counts_match_profiler_world4(kw):
    _check_counts(kw, 4)


def _check_counts(kw: dict, world: int) -> None:
    from dataclasses import asdict

    from seqpar.planner.collectives import step_collectives
    from seqpar.planner.measure import Case, measure_case
    from seqpar.planner.validate import _features, model_facts
    from seqpar.spawn import run_distributed

    case = Case(seq_len=256, **{"memory": {"fused_loss": False}, **kw})
    assert case.world == world
    res = run_distributed(measure_case, world, asdict(case), meter=False, collectives=True, timeout=300)
    wl = Workload(case.seq_len, case.stage, case.finetuning, case.precision)
    predicted: dict[str, int] = {}
    for c in step_collectives(model_facts(case), wl, Layout(case.ulysses, case.ring, case.dp), _features(case)):
        predicted[c.kind] = predicted.get(c.kind, 0) + c.calls
    assert res[0]["collectives"] == predicted


@pytest.mark.slow
def test_time_ordering_on_this_machine():
    """The fast subset of `seqpar plan --validate-time`: rows whose work differs clearly (checkpointing
    recomputes the forward, twice the length quadruples attention) are ordered as measured."""
    from seqpar.planner.validate import FAST_TIME_GRID, format_time_rows, run_time_validation, time_ordering

    rows = run_time_validation(FAST_TIME_GRID, timed_steps=3)
    same, total, _ = time_ordering(rows)
    assert total >= 2 and same == total, format_time_rows(rows)


def test_unmodelled_architectures_refused(tmp_path):
    """MoE other than Qwen3-Next / Qwen3.5-MoE's (Nemotron-H's MoE blocks included), vision-language configs and
    unknown layer types would be planned wrong: refused with what is missing (not silently mis-planned). Hybrids
    with a mixer and an MLP per layer, Nemotron-H's blocks of one mixer or one dense MLP and Qwen3-Next's MoE MLPs
    are planned (tests/test_planner_hybrid.py, _blocks.py, _moe.py)."""
    from seqpar.hf.models import tiny_config

    tiny_config("qwen3_next", 4, 2).save_pretrained(tmp_path / "q3n")
    assert load_model_facts(str(tmp_path / "q3n")).moe is not None
    with pytest.raises(SeqParError, match="mixture-of-experts"):
        load_model_facts("tiny:nemotron_h", {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]})
    assert load_model_facts("tiny:nemotron_h", {"layers_block_type": ["linear_attention", "mlp"]}).blocks
    dense = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
             "vocab_size": 512}
    for extra, what in (({"num_local_experts": 8}, "mixture-of-experts"),
                        ({"model_type": "qwen3_moe", "num_experts": 8}, "mixture-of-experts"),
                        ({"vision_config": {}, "text_config": dense}, "vision tower")):
        path = tmp_path / f"{what}.json"
        path.write_text(json.dumps({**dense, **extra}))
        with pytest.raises(SeqParError, match=what):
            load_model_facts(str(path))
    path = tmp_path / "conv.json"
    path.write_text(json.dumps({**dense, "layer_types": ["conv", "full_attention"]}))
    with pytest.raises(SeqParError, match=r"layer types it does not model \(\['conv'\]\)"):
        load_model_facts(str(path))
    path = tmp_path / "rwkv_like.json"  # a recurrent layer kind no family names: refused, not planned as attention
    path.write_text(json.dumps({**dense, "layer_types": ["rwkv", "full_attention"]}))
    with pytest.raises(SeqParError, match=r"layer types it does not model \(\['rwkv'\]\)"):
        load_model_facts(str(path))
    assert load_model_facts("tiny:recurrent_gemma").recurrent.kind == "rglru"  # (planned: test_planner_families.py)
    ok = tmp_path / "dense.json"
    ok.write_text(json.dumps({**dense, "layer_types": ["full_attention", "sliding_attention"]}))
    assert load_model_facts(str(ok)).layers == 2
    # a VL model: refused with the way to plan it (its text decoder from text_config, the tower measured)
    vl = tiny_config("qwen2_5_vl", 4, 2)
    vl.save_pretrained(tmp_path / "vl")
    with pytest.raises(SeqParError, match=r"text_config.*--seq-len = text \+ vision tokens") as saved:
        load_model_facts(str(tmp_path / "vl"))
    for arch in ("qwen2_5_vl", "qwen3_vl"):  # the shipped tiny VL models: the same message, not "unknown tiny"
        with pytest.raises(SeqParError) as e:
            load_model_facts(f"tiny:{arch}")
        assert str(e.value).replace(f"'tiny:{arch}'", "X") == str(saved.value).replace(f"'{tmp_path / 'vl'}'", "X")
    with pytest.raises(SeqParError, match=r"unknown tiny architecture 'foo': use tiny:<llama\|.*\|bamba\|.*>"):
        load_model_facts("tiny:foo")
    (tmp_path / "vl_text.json").write_text(json.dumps({**vl.text_config.to_dict(), "model_type": "qwen2"}))
    assert load_model_facts(str(tmp_path / "vl_text.json")).layers == 2
