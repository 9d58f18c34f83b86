"""seqpar.threaded: a world of ranks as threads of one process (the fast SP > 1 harness, and the only way to run
SP > 1 on one GPU). It must give what gloo processes give (bitwise, for attention in every mode), pass point-to-
point messages in order, end a world whose rank failed or hung with that rank's report (never hang), and run whole
`seqpar train` loops: SP 4 (Ulysses 4, ring 4, USP 2 x 2, with distributed checkpoints) equal to SP 1 within 1e-5
(fp32, SGD) for a Llama-shaped and a Qwen3.5-shaped (Gated DeltaNet) tiny model."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from threaded_cases import compare_rows, train_rows

import seqpar
from seqpar.comm import RingComm, send_recv
from seqpar.spawn import DistributedFailure, run_distributed
from seqpar.threaded import cpu_time, run_threaded


def attention_world():
    out = []
    for u, r in ((4, 1), (1, 4), (2, 2)):
        mesh = seqpar.init_mesh(4, ulysses_degree=u, ring_degree=r)
        for b, cu, (hq, hkv) in ((2, None, (6, 2)), (1, [0, 1, 9, 30, 31, 48], (4, 1))):
            g = torch.Generator().manual_seed(7)
            q, k, v = (torch.randn(b, 48, h, 16, generator=g) for h in (hq, hkv, hkv))
            ql, kl, vl = (seqpar.shard(t, mesh, 1).clone().requires_grad_() for t in (q, k, v))
            o = seqpar.attention(ql, kl, vl, mesh, cu_seqlens=cu)
            o.square().sum().backward()
            out.append([o.detach(), ql.grad, kl.grad, vl.grad])
    x = torch.randn(4096, generator=torch.Generator().manual_seed(dist.get_rank())) * torch.logspace(-3, 3, 4096)
    scale = x.abs()
    for t in (x, scale):  # a float sum over 4 ranks: gloo's ring adds in another order than torch.testing's group
        dist.all_reduce(t)
    return out, (x, scale)


def test_threads_equal_gloo_processes_bitwise_except_sums_over_3_or_more_ranks():
    threads = run_threaded(attention_world, 4, timeout=120)
    procs = run_distributed(attention_world, 4, timeout=300)
    for (rt, (st, scale)), (rp, (sp, _)) in zip(threads, procs):
        for ct, cp in zip(rt, rp):  # attention in every mode: all-to-all, point-to-point, no sum over ranks
            assert all(torch.equal(a, b) for a, b in zip(ct, cp))
        # all_reduce: equal to fp32 rounding (3 adds of at most 2^-24 of the magnitudes each), not bitwise
        # (docs/gpu.md says so; training loops: SP 4 = SP 1 within 1e-5)
        assert bool(((st - sp).abs() <= 3 * 2.0**-24 * scale).all()) and not torch.equal(st, sp)


def cpu_world():
    t0, p0 = time.thread_time(), time.process_time()
    c0 = cpu_time()
    if dist.get_rank() == 0:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # rank 0 works, rank 1 waits at the barrier
            pass
    dist.barrier()
    return cpu_time() - c0, time.process_time() - p0, time.thread_time() - t0


def test_cpu_time_is_the_ranks_own_in_threads():
    """step_cpu_s reads cpu_time(): in a threaded world the rank's thread, not the process (every rank's)."""
    (busy, _, _), (idle, idle_process, _) = run_threaded(cpu_world, 2, timeout=60)
    assert busy >= 0.29 and idle < 0.1 and idle_process >= 0.29


def p2p_world():
    rank, world = dist.get_rank(), dist.get_world_size()
    got = [send_recv(torch.full((3,), float(rank * 10 + i)), (rank + 1) % world, torch.empty(3), (rank - 1) % world,
                     dist.group.WORLD) for i in range(3)]  # three messages on one pair: first in, first out
    ring = RingComm(dist.group.WORLD)
    ring.start([torch.tensor([float(rank)]), torch.tensor([rank + 0.5])])
    a, b = ring.wait()
    return [float(t[0]) for t in got], float(a), float(b)


def test_point_to_point_in_order():
    for rank, (got, a, b) in enumerate(run_threaded(p2p_world, 3, timeout=60)):
        prev = (rank - 1) % 3
        assert got == [prev * 10.0, prev * 10 + 1.0, prev * 10 + 2.0] and (a, b) == (prev, prev + 0.5)


def failing_world(how: str):
    if dist.get_rank() == 1:
        if how == "raise":
            raise ValueError("rank 1 broke")
        time.sleep(4)  # "hang": reaches the collective below after its world is over (and must not disturb later ones)
    dist.all_reduce(torch.ones(1))
    if how == "recv" and dist.get_rank() == 0:
        send_recv(None, None, torch.empty(1), 1, dist.group.WORLD)  # nobody sends: waits until stopped


def test_a_failing_rank_ends_the_world_with_its_report():
    with pytest.raises(DistributedFailure, match="rank 1 broke") as e:
        run_threaded(failing_world, 3, "raise", timeout=60)
    assert "stopped" not in str(e.value).splitlines()[0]
    t = time.monotonic()
    with pytest.raises(DistributedFailure, match="timed out after 2s; ranks still running"):
        run_threaded(failing_world, 2, "hang", timeout=2)
    assert time.monotonic() - t < 10
    with pytest.raises(DistributedFailure, match="timed out"):
        run_threaded(failing_world, 2, "recv", timeout=2)


@pytest.mark.parametrize("model", ["llama", "qwen3_5"])
def test_train_loop_sp4_equals_sp1_in_threads(tmp_path, model):
    ref = train_rows(tmp_path / "sp1", model, 1, 1)
    for u, r in ((4, 1), (1, 4), (2, 2)):
        compare_rows(train_rows(tmp_path / f"u{u}r{r}", model, u, r), ref, 1e-5)
    assert ref[-1]["loss"] < ref[0]["loss"]  # it trains
