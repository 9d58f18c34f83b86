"""The overlapped gradient sum (`seqpar.loss.grad_sync.OverlappedGradSum`, what `seqpar train` uses for
replicated parameters on more than one rank): posted during the step's last backward, it gives bitwise the
gradients of the after-backward `sum_gradients`, and both equal the single-process float64 gradient of all
ranks' losses (tolerance 1e-12 relative: float64, only the summation order differs).

Awkward cases on purpose: a tied weight (embedding = output head), a parameter some ranks use only in an
earlier micro-batch (its gradient exists but is not produced by the armed backward), one some ranks never use
(no gradient at all: zeros), small parameters (coalesced into one buffer), odd sp (3), and sp x dp (2 x 2:
the dp sum runs after the overlapped sp sum).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seqpar.spawn import run_distributed

V, H, T, MICRO = 300, 256, 12, 2  # V * H and H * H >= comm.IN_PLACE_MIN_NUMEL: summed in place, overlapped


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, H)
        self.l1 = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)
        self.expert = nn.Linear(H, H, bias=False)  # used where (rank + micro) is even
        self.rare = nn.Linear(H, H, bias=False)  # used by rank 1 only
        self.l2 = nn.Linear(H, H, bias=False)
        self.double()

    def forward(self, ids: torch.Tensor, rank: int, micro: int) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(ids)))
        if (rank + micro) % 2 == 0:
            h = h + self.expert(h)
        if rank == 1:
            h = h + self.rare(h)
        return self.l2(self.norm(h)) @ self.emb.weight.t()  # tied output head


def loss_of(model: Net, rank: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + micro)
    ids, tgt = torch.randint(0, V, (2, T), generator=g), torch.randint(0, V, (2, T), generator=g)
    logits = model(ids, rank, micro)
    return nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="sum") / 1000.0


def _worker(sp: int) -> dict:
    import torch.distributed as dist

    import seqpar
    from seqpar.loss import sum_gradients
    from seqpar.loss.grad_sync import OverlappedGradSum

    rank = dist.get_rank()
    mesh = seqpar.init_mesh(sp, ulysses_degree=1, ring_degree=sp)
    overlapped, plain = Net(), Net()
    gs = OverlappedGradSum(overlapped.parameters(), mesh)
    for m in range(MICRO):
        if m == MICRO - 1:
            gs.arm()
        loss_of(overlapped, rank, m).backward()
        loss_of(plain, rank, m).backward()
    gs.finish()
    sum_gradients(plain.parameters(), mesh)
    bitwise = all(torch.equal(a.grad, b.grad) for a, b in zip(overlapped.parameters(), plain.parameters()))
    grads = {n: p.grad.clone() for n, p in overlapped.named_parameters()}
    # Unarmed backwards (the earlier micro-batches of a step) post nothing.
    loss_of(overlapped, rank, 0).backward()
    idle = len(gs._works) == 0
    gs.close()
    return {"bitwise": bitwise, "posted": gs.posted_in_backward, "idle": idle, "grads": grads}


def reference(world: int) -> dict[str, torch.Tensor]:
    model = Net()
    for rank in range(world):
        for m in range(MICRO):
            loss_of(model, rank, m).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,sp", [(3, 3), (4, 2)])
def test_overlapped_sum_equals_sum_gradients_and_reference(world, sp):
    results = run_distributed(_worker, world, sp, timeout=120)
    ref = reference(world)
    for r, res in enumerate(results):
        assert res["bitwise"], f"rank {r}: overlapped sum differs from sum_gradients"
        assert res["posted"] >= 1, f"rank {r}: nothing was posted during backward (no overlap)"
        assert res["idle"], f"rank {r}: an unarmed backward posted a sum"
        for n, want in ref.items():
            torch.testing.assert_close(res["grads"][n], want, rtol=1e-12, atol=1e-14,
                                       msg=lambda m, n=n, r=r: f"rank {r} {n}: {m}")


def test_when_seqpar_train_overlaps():
    """grad_sync: auto overlaps on CUDA meshes only; never under FSDP, fp32 masters, or one rank; overlap with
    precision bf16 (fp32 masters, no FSDP) is refused when the config is read."""
    from types import SimpleNamespace

    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict
    from seqpar.train.loop.build import overlaps_grad_sync

    def cfg(**kw):
        return config_from_dict({"model": "tiny:llama", "dataset": {"path": "x.jsonl", "max_length": 64}, **kw})

    cpu, cuda = SimpleNamespace(comm_device=torch.device("cpu")), SimpleNamespace(comm_device=torch.device("cuda", 0))
    assert not overlaps_grad_sync(cfg(), cpu, 2, False) and overlaps_grad_sync(cfg(), cuda, 2, False)
    assert overlaps_grad_sync(cfg(grad_sync="overlap"), cpu, 2, False)
    assert not overlaps_grad_sync(cfg(grad_sync="after_backward"), cuda, 2, False)
    assert not overlaps_grad_sync(cfg(grad_sync="overlap"), cpu, 1, False)
    assert not overlaps_grad_sync(cfg(grad_sync="overlap", fsdp=True), cpu, 2, False)
    assert not overlaps_grad_sync(cfg(), cuda, 2, True)  # bf16 masters under auto: summed after backward
    with pytest.raises(SeqParError, match="grad_sync: overlap.*bf16"):
        cfg(grad_sync="overlap", precision="bf16")
    assert overlaps_grad_sync(cfg(grad_sync="overlap", precision="bf16-pure"), cpu, 2, False)


def _twice_worker() -> str:
    import seqpar
    from seqpar.errors import SeqParError
    from seqpar.loss.grad_sync import OverlappedGradSum

    mesh = seqpar.init_mesh(2, ulysses_degree=1, ring_degree=2)
    model = Net()
    gs = OverlappedGradSum(model.parameters(), mesh)
    gs.arm()
    loss_of(model, 0, 0).backward()
    try:
        loss_of(model, 0, 1).backward()  # a second armed backward: l2's gradient is already being summed
    except SeqParError as e:
        msg = str(e)
    else:
        msg = "no error"
    gs.finish()  # every rank still completes the same collectives
    return msg


def test_second_armed_backward_is_refused():
    for msg in run_distributed(_twice_worker, 2, timeout=60):
        assert "accumulated again after its all-reduce was posted" in msg, msg
