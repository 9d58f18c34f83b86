"""Length-aware SP balances with the rates of the device it trains on (train/loop/dynamic.device_machine, timed by
seqpar.dynamic.device), not a fixed CPU or H100 preset: on a CPU this machine's matmul rate scales the measured
CPU shape; on an accelerator its own matmul and attention rates replace H100's."""

from __future__ import annotations

import torch

from seqpar.dynamic import device as dev
from seqpar.train.loop import dynamic as dyn


def _cfg(precision="bf16"):
    from seqpar.train.config import config_from_dict

    return config_from_dict({"model": {"name": "tiny:llama"}, "dataset": {"path": "x.jsonl", "max_length": 64},
                             "precision": precision})


def test_cpu_rates_follow_this_machines_matmul_speed(monkeypatch):
    monkeypatch.setattr(dyn, "matmul_flops", lambda device, dtype: 2 * dyn.CPU_MATMUL_FLOPS)
    machine, rate = dyn.device_machine(_cfg(), torch.device("cpu"), 32)
    assert rate == 2 * dyn.CPU_MATMUL_FLOPS
    assert machine.attn_by_len == tuple((n, 2 * r) for n, r in dyn.CPU_MACHINE.attn_by_len)
    assert machine.host_layer_s == dyn.CPU_MACHINE.host_layer_s / 2 and machine.per_kind == dyn.CPU_MACHINE.per_kind


def test_accelerator_rates_are_measured_not_h100s(monkeypatch):
    seen = []
    monkeypatch.setattr(dyn, "matmul_flops", lambda device, dtype: seen.append(dtype) or 123e12)
    monkeypatch.setattr(dyn, "attention_rates", lambda device, dtype, d: ((256, 50.0), (4096, 300.0)))
    machine, rate = dyn.device_machine(_cfg(), torch.device("cuda"), 128)
    assert rate == 123e12 and machine.attn_by_len == ((256, 50.0), (4096, 300.0)) and seen == [torch.bfloat16]
    dyn.device_machine(_cfg("fp32"), torch.device("cuda"), 128)
    assert seen[-1] == torch.float32


def test_the_timings_are_real_and_quick_on_this_cpu():
    cpu = torch.device("cpu")
    assert 1e8 < dev.matmul_flops(cpu, reps=2) < 1e13
    rates = dev.attention_rates(cpu, torch.float32, 16, heads=1, lengths=(64, 256), reps=1)
    assert [n for n, _ in rates] == [64, 256] and all(0 < r < 10 for _, r in rates)
    assert dev.agree([1.0, 2.0], None, cpu) == [1.0, 2.0]


def _agreed():
    import torch.distributed as dist

    return dev.agree([float(dist.get_rank() + 1), 5.0], dist.group.WORLD, torch.device("cpu"))


def test_every_rank_takes_the_slowest_ranks_rates():
    from seqpar.threaded import run_threaded

    assert run_threaded(_agreed, 3, timeout=60) == [[1.0, 5.0]] * 3
