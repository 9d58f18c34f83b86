"""seqpar.memory.meter.PeakMemoryMeter: exact byte counts on known tensor programs, and in `seqpar train`.

Single process: every expected number below is derived by hand from what the program keeps alive
(comments give the derivation); the comparisons are exact (integers, tolerance 0).

One 2-rank gloo world runs `seqpar train` (SP=2 ring, full / LoRA / FSDP2 / DPO, grad_accum=2) with
the meter on and off: the losses must be bitwise identical (the meter observes, it must not change
anything), and within 1e-5 of an SP=1 single-process run; the per-rank split at the peak must hold
exactly the parameter and AdamW-state bytes, and metrics.jsonl's peak_alloc_mb must be the max over
ranks of the per-rank peaks.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from procs import phrase

from seqpar.memory.meter import CATEGORIES, PeakMemoryMeter, activation_bytes
from seqpar.spawn import run_distributed

F32 = 4


def test_known_allocations_exact():
    lin = torch.nn.Linear(10, 20)  # 220 params
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 10)).sum().backward()
    opt.step()  # momentum buffers: as many bytes as the parameters
    opt.zero_grad(set_to_none=True)
    meter = PeakMemoryMeter(lin, opt)
    with meter.measure():
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500, dtype=torch.float64)  # 4000 B
        del a
        c = torch.empty(2000)  # 8000 B: the peak is b + c = 12000 B, not a + b
        v = c.view(40, 50)  # a view: no new storage
        del b, c, v
    model_state = 220 * F32 * 2  # parameters + momentum
    last = meter.last
    assert last["peak_bytes"] == last["tracked_peak_bytes"] == model_state + 12000
    assert last["by_category"] == {**dict.fromkeys(CATEGORIES, 0), "Parameter": 880, "Optstate": 880,
                                   "Activation": 12000}
    assert activation_bytes(last) == 12000
    assert last["source"] == "tensor_tracker"


def _mlp_step(m, opt, x, gy_shape, micro=1):
    for _ in range(micro):
        gy = torch.randn(gy_shape)
        y = m(x)
        y.backward(gy)
        del y, gy
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("micro", [1, 2])
def test_linear_gelu_linear_exact(micro):
    S, D, H = 64, 16, 48
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(S, D)  # allocated before the step, not the model's: not counted
    P = sum(p.numel() for p in m.parameters()) * F32
    meter = PeakMemoryMeter(m, opt)
    for step in range(2):
        with meter.measure():
            _mlp_step(m, opt, x, (S, D), micro)
        # The peak is in the second Linear's backward: alive are the output gradient gy and the output
        # y [S,D], the forward activations h = Linear1(x) and g = GELU(h) [S,H] (saved for backward),
        # the new input gradient dL/dg [S,H] and the new W2 [D,H] and b2 [D] gradients (Temp until
        # accumulated). (The GELU backward, next, frees g and allocates dL/dh: the same bytes.)
        act = 2 * S * D * F32 + 2 * S * H * F32
        temp = S * H * F32 + (D * H + D) * F32
        grads = P if micro == 2 else 0  # second micro-batch: the first one's .grad are alive
        opt_state = P if step == 1 else 0  # momentum buffers exist from the first optimizer step on
        assert meter.last["peak_bytes"] == P + act + temp + grads + opt_state
        assert meter.last["by_category"] == {**dict.fromkeys(CATEGORIES, 0), "Parameter": P, "Activation": act,
                                             "Temp": temp, "Gradient": grads, "Optstate": opt_state}
        assert activation_bytes(meter.last) == act + temp


def test_failed_block_keeps_last_reading():
    m = torch.nn.Linear(4, 4)
    meter = PeakMemoryMeter(m)
    with meter.measure():
        torch.empty(10)
    first = meter.last
    with pytest.raises(RuntimeError, match="boom"), meter.measure():
        raise RuntimeError("boom")
    assert meter.last is first


# ----------------------------------------------------------------------------- seqpar train, 2 ranks
CASES = {
    "ring_full": {},
    "ring_lora": {"finetuning": {"method": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}},
    "fsdp": {"fsdp": True},
    # The memory features (no-ops until their branches are merged): recomputation under the tracker.
    "features": {"memory": {"activation_checkpointing": True, "tiled_mlp": 2}},
    "dpo_full": {"stage": "dpo"},  # a frozen reference copy: its parameters count too
    "dpo_lora": {"stage": "dpo", "finetuning": {"method": "lora", "r": 4, "alpha": 8, "targets": ["q_proj"]}},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("meter")
    rng = random.Random(0)
    (d / "sft.jsonl").write_text("".join(json.dumps({"instruction": phrase(rng, 1, 5),
                                                     "response": phrase(rng, 2, 8)}) + "\n" for _ in range(8)))
    (d / "dpo.jsonl").write_text("".join(json.dumps({"prompt": phrase(rng, 1, 4), "chosen": phrase(rng, 1, 5),
                                                     "rejected": phrase(rng, 2, 6)}) + "\n" for _ in range(8)))
    return d


def _cfg(data, out, name, measure, sp=2):
    extra = CASES[name]
    stage = extra.get("stage", "sft")
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(data / f"{stage}.jsonl"), "max_length": 64},
        "sequence_parallel": {"size": sp, "ring_degree": sp} if sp > 1 else 1,
        "micro_batch_size": 2, "grad_accum": 2, "max_steps": 2, "optimizer": {"lr": 1e-2},
        "output_dir": str(out), "progress": False, **extra, "memory": {**extra.get("memory", {}), "measure": measure},
    }


def _state_bytes(model, optimizer, ref_model=None):
    models = [model] + ([ref_model] if ref_model is not None else [])
    params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                 for m in models for p in m.parameters()) * F32
    opt = sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
              for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    return params, opt


def _meter_world(cases):
    from seqpar.train import run
    from seqpar.train.config import config_from_dict

    seen = {}
    real = run.finish

    def spy(loop, result, metrics_path):  # the exact bytes the rank holds, read from the objects themselves
        seen["state"] = _state_bytes(loop.model, loop.optimizer, getattr(loop.reference, "ref_model", None))
        return real(loop, result, metrics_path)

    run.finish = spy
    out = {}
    for key, cfg in cases:
        res = run.train(config_from_dict(cfg))
        out[key] = {"losses": res.losses, "peak_alloc": res.peak_alloc, "state": seen.pop("state")}
    return out


@pytest.fixture(scope="module")
def world(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("meter_runs")
    cases = [((name, m), _cfg(data, tmp / f"{name}_{m}", name, m)) for name in CASES for m in (True, False)]
    ranks = run_distributed(_meter_world, 2, cases, timeout=600)
    return {"ranks": ranks, "tmp": tmp}


@pytest.mark.parametrize("name", list(CASES))
def test_train_meter_is_exact_and_changes_nothing(world, data, name):
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    ranks, tmp = world["ranks"], world["tmp"]
    on, off = ranks[0][(name, True)], ranks[0][(name, False)]
    assert on["losses"] == off["losses"]  # bitwise: the tracker only observes
    ref = train(config_from_dict(_cfg(data, tmp / f"{name}_ref", name, False, sp=1)))
    assert max(abs(a - b) for a, b in zip(on["losses"], ref.losses)) <= 1e-5
    assert off["peak_alloc"] == []
    rows = [json.loads(ln) for ln in (tmp / f"{name}_True" / "metrics.jsonl").read_text().splitlines()]
    rows_off = [json.loads(ln) for ln in (tmp / f"{name}_False" / "metrics.jsonl").read_text().splitlines()]
    assert all("peak_alloc_mb" not in r and "peak_mem_mb" in r for r in rows_off)
    for step, row in enumerate(rows):
        per_rank = [r[(name, True)]["peak_alloc"][step] for r in ranks]
        assert row["peak_alloc_mb"] == max(p["peak_bytes"] for p in per_rank) / 2**20
        assert "peak_mem_mb" in row
        for p in per_rank:
            assert p["peak_bytes"] == sum(p["by_category"].values()) > 0
            assert p["by_category"]["Activation"] + p["by_category"]["Temp"] > 0
    for r in ranks:
        params, opt = r[(name, True)]["state"]
        last = r[(name, True)]["peak_alloc"][-1]["by_category"]
        assert last["Optstate"] == opt > 0  # second step: AdamW state exists throughout, exactly counted
        if name == "fsdp":
            # Local shards always; the all-gathered layer parameters on top while they exist.
            assert last["Parameter"] >= params
        else:
            assert last["Parameter"] == params


def test_demo_prints_both_peaks(tmp_path):
    from seqpar.demo import _peak_alloc_line

    for run, peaks in (("sp", [10.5, 12.25]), ("ref", [40.0, 41.5])):
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "loss": 1.0, "peak_alloc_mb": p}) + "\n" for i, p in enumerate(peaks)))
    line = _peak_alloc_line(tmp_path, 4)
    assert "SP=4 12.2 MiB vs SP=1 41.5 MiB (0.30x)" in line


def test_activation_bytes_needs_the_split():
    with pytest.raises(ValueError, match="categories=True"):
        activation_bytes({"peak_bytes": 100, "by_category": {}})


def test_host_state_bytes_counts_what_lives_off_the_device():
    """FSDP2's CPU offload keeps parameters / gradients / optimizer state on the host: counted once each (shared
    storage once) when the step's device is an accelerator (meta stands for it), nothing on the CPU."""
    from seqpar.memory.meter import host_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert host_state_bytes(model, opt, torch.device("meta")) == 4 * (n + n + 2 * n) + 4 * 3  # + 3 scalar steps
    assert host_state_bytes(model, opt, torch.device("cpu")) == 0
