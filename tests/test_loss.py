"""SFT and DPO/IPO/SimPO losses under SP vs an independent single-process reference.

Model: a tiny per-token "LM" (token + position embedding, tanh, linear head) -- no attention is
needed to test the loss path, and position embeddings make wrong position_ids visible. The
reference runs each row unpadded, unsharded, in one process, with the textbook formulas written
here (no seqpar code). Under SP every rank collates its dp slice, computes its loss share,
backpropagates, and gradients are SUMMED over dp x sp (`sum_gradients`); the summed shares and
gradients must equal the reference. Tolerance: fp32, 1e-5 absolute + 1e-5 relative.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

import seqpar
from seqpar.data import SequenceParallelCollator, SequenceParallelDPOCollator
from seqpar.loss import (
    dpo_loss,
    global_loss,
    global_token_count,
    gradient_reduction_factor,
    sequence_logps,
    sft_loss,
    sum_gradients,
)
from seqpar.spawn import run_distributed

IGN = -100
PAD = 0
V, H, PMAX = 37, 16, 256
TOL = dict(atol=1e-5, rtol=1e-5)


class Tiny(nn.Module):
    def __init__(self, seed: int, vocab: int = V) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, H)
        self.pos = nn.Embedding(PMAX, H)
        self.head = nn.Linear(H, vocab)

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.emb(ids) + self.pos(pos))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids, pos))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- data shared by workers
def sft_micro_batches() -> list[list[dict]]:
    """Two micro-batches of the GLOBAL step, uneven token counts; includes a row whose targets sit
    at its very start (one shard only) and a row with no supervised token at all."""
    rng = random.Random(5)

    def row(n, p_sup=0.8):
        ids = [rng.randrange(1, V) for _ in range(n)]
        return {"input_ids": ids, "labels": [t if rng.random() < p_sup else IGN for t in ids]}

    early = row(31)
    early["labels"] = [IGN, early["input_ids"][1], early["input_ids"][2]] + [IGN] * 28
    silent = row(9)
    silent["labels"] = [IGN] * 9
    mb0 = [row(29), early, row(17), row(40)]
    mb1 = [row(5, 0.5), silent, row(11, 0.3), row(3)]
    return [mb0, mb1]


def dpo_pairs() -> list[dict]:
    rng = random.Random(9)
    tok = lambda n: [rng.randrange(1, V) for _ in range(n)]
    return [
        {"prompt_input_ids": tok(p), "chosen_input_ids": tok(c), "rejected_input_ids": tok(r)}
        for p, c, r in ((7, 5, 9), (3, 14, 2), (11, 1, 6), (2, 8, 8))
    ]


# ----------------------------------------------------------------------------- independent references
def ref_row_nll(model: nn.Module, ids: list[int], labels: list[int]) -> tuple[torch.Tensor, int]:
    """Sum of next-token NLL over supervised targets of one row (full row, positions 0..n-1)."""
    x = torch.tensor(ids)
    logp = torch.log_softmax(model(x[None], torch.arange(len(ids))[None])[0], dim=-1)
    total, count = logp.new_zeros(()), 0
    for j in range(len(ids) - 1):
        if labels[j + 1] >= 0:
            total = total - logp[j, labels[j + 1]]
            count += 1
    return total, count


def ref_sft(micro_batches: list[list[dict]]) -> tuple[float, dict]:
    model = Tiny(0)
    parts = [ref_row_nll(model, r["input_ids"], r["labels"]) for mb in micro_batches for r in mb]
    count = sum(c for _, c in parts)
    loss = sum(t for t, _ in parts) / max(count, 1)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    return float(torch.as_tensor(loss).detach()), grads(model)


def ref_seq_logp(model: nn.Module, prompt: list[int], comp: list[int]) -> tuple[torch.Tensor, int]:
    nll, count = ref_row_nll(model, prompt + comp, [IGN] * len(prompt) + comp)
    return -nll, count


def ref_dpo(pairs: list[dict], loss_type: str, beta: float, gamma: float) -> tuple[float, dict]:
    policy, ref = Tiny(0), Tiny(1)
    losses = []
    for p in pairs:
        pc, nc = ref_seq_logp(policy, p["prompt_input_ids"], p["chosen_input_ids"])
        pr, nr = ref_seq_logp(policy, p["prompt_input_ids"], p["rejected_input_ids"])
        with torch.no_grad():
            rc, _ = ref_seq_logp(ref, p["prompt_input_ids"], p["chosen_input_ids"])
            rr, _ = ref_seq_logp(ref, p["prompt_input_ids"], p["rejected_input_ids"])
        if loss_type == "sigmoid":
            z = beta * ((pc - rc) - (pr - rr))
            losses.append(torch.log1p(torch.exp(-z)))
        elif loss_type == "ipo":
            h = (pc / nc - rc / nc) - (pr / nr - rr / nr)
            losses.append((h - 1 / (2 * beta)) ** 2)
        else:
            z = beta * (pc / nc - pr / nr) - gamma
            losses.append(torch.log1p(torch.exp(-z)))
    loss = torch.stack(losses).mean()
    loss.backward()
    return float(loss.detach()), grads(policy)


# ----------------------------------------------------------------------------- SP side (per rank)
MESHES = {  # name: (sp_size, ring, ulysses)  -- world of 4 ranks
    "ring4": (4, 4, 1),
    "uly4": (4, 1, 4),
    "usp2x2": (4, 2, 2),
    "dp2_ring2": (2, 2, 1),  # dp rank 1's SP group {2, 3} excludes global rank 0
    "dp2_uly2": (2, 1, 2),
    "ring3": (3, 3, 1),  # world of 3 ranks
    "uly3": (3, 1, 3),
}
WORLD4 = ["ring4", "uly4", "usp2x2", "dp2_ring2", "dp2_uly2"]


def sp_sft(mesh, micro_batches, packing: bool, chunked: bool, ddp_average: bool = False):
    model = Tiny(0)
    col = SequenceParallelCollator(mesh, PAD, packing=packing)
    batches = [col(mb[mesh.dp_rank :: mesh.dp_size]) for mb in micro_batches]
    # The denominator covers both micro-batches and all dp ranks.
    n = global_token_count(sum(b["num_supervised_tokens"] for b in batches), mesh)
    share_sum = torch.zeros(())
    for b in batches:
        if chunked:
            h = model.hidden(b["input_ids"], b["position_ids"])
            loss = sft_loss(None, b["shift_labels"], n, hidden=h, lm_head=model.head, chunk_size=5)
        else:
            loss = sft_loss(model(b["input_ids"], b["position_ids"]), b["shift_labels"], n)
        if ddp_average:
            loss = loss * gradient_reduction_factor(mesh)
        loss.backward()
        share_sum += loss.detach()
    if ddp_average:  # what DDP/FSDP do: average over all ranks
        for p in model.parameters():
            seqpar.comm.all_reduce_(p.grad, mesh.sp_group)
            seqpar.comm.all_reduce_(p.grad, mesh.dp_group)
            p.grad /= mesh.world_size
        share_sum /= gradient_reduction_factor(mesh)
    else:
        sum_gradients(model.parameters(), mesh)
    return float(global_loss(share_sum, mesh)), grads(model)


def sp_dpo(mesh, pairs, loss_type: str, beta: float, gamma: float, chunked: bool, accum: bool = False):
    policy, ref = Tiny(0), Tiny(1)
    mine = pairs[mesh.dp_rank :: mesh.dp_size]
    col = SequenceParallelDPOCollator(mesh, PAD)
    # accum: one pair per micro-batch, the denominator = pairs of the whole step over dp.
    batches = [col([p]) for p in mine] if accum else [col(mine)]
    num_pairs = global_token_count(sum(b["num_pairs"] for b in batches), mesh) if accum else None
    share_sum, metric_losses = torch.zeros(()), []
    for b in batches:
        nb = int(b["num_pairs"])
        ids, pos, y = b["input_ids"], b["position_ids"], b["shift_labels"]
        if chunked:
            lp, cnt = sequence_logps(None, y, mesh, hidden=policy.hidden(ids, pos), lm_head=policy.head, chunk_size=3)
        else:
            lp, cnt = sequence_logps(policy(ids, pos), y, mesh)
        with torch.no_grad():
            rlp, _ = sequence_logps(ref(ids, pos), y, mesh)
        loss, metrics = dpo_loss(
            lp[:nb], lp[nb:], rlp[:nb], rlp[nb:], beta=beta, gamma=gamma, loss_type=loss_type,
            chosen_counts=cnt[:nb], rejected_counts=cnt[nb:], mesh=mesh, num_pairs=num_pairs,
        )
        loss.backward()
        share_sum += loss.detach()
        metric_losses.append(float(metrics["loss"]) * nb)
        assert all(not v.requires_grad for v in metrics.values())
    sum_gradients(policy.parameters(), mesh)
    return float(global_loss(share_sum, mesh)), grads(policy), sum(metric_losses) / len(mine)


DPO_CASES = [("sigmoid", 0.5, 0.0, False), ("ipo", 0.3, 0.0, False), ("simpo", 2.0, 0.7, False),
             ("sigmoid", 0.5, 0.0, True), ("ipo", 0.3, 0.0, True, True)]  # (..., chunked, grad accum)


def _world_worker(mesh_names: list[str]) -> dict:
    torch.manual_seed(0)
    mbs, pairs = sft_micro_batches(), dpo_pairs()
    silent = [[{"input_ids": r["input_ids"], "labels": [IGN] * len(r["input_ids"])} for r in mb] for mb in mbs]
    out = {}
    for name in mesh_names:
        sp, ring, uly = MESHES[name]
        mesh = seqpar.init_mesh(sp, ring_degree=ring, ulysses_degree=uly)
        for packing in (False, True):
            for chunked in (False, True):
                out[name, "sft", packing, chunked] = sp_sft(mesh, mbs, packing, chunked)
        out[name, "sft_ddp"] = sp_sft(mesh, mbs, False, False, ddp_average=True)
        out[name, "zero"] = sp_sft(mesh, silent, True, True)
        out[name, "zero_plain"] = sp_sft(mesh, silent, False, False)
        for case in DPO_CASES:
            out[(name, "dpo", *case)] = sp_dpo(mesh, pairs, *case)
    return out


def check_world(results: list[dict], world: int) -> None:
    mbs, pairs = sft_micro_batches(), dpo_pairs()
    ref_loss, ref_grads = ref_sft(mbs)
    dpo_refs = {case: ref_dpo(pairs, *case[:3]) for case in DPO_CASES}
    checked = 0
    for rank in range(world):
        for key, val in results[rank].items():
            if key[1] in ("sft", "sft_ddp"):
                loss, g = val
                exp_loss, exp_g = ref_loss, ref_grads
            elif key[1] in ("zero", "zero_plain"):
                loss, g = val
                assert math.isfinite(loss) and loss == 0.0, key
                for n, t in g.items():
                    assert t is not None and torch.isfinite(t).all() and (t == 0).all(), (key, n)
                checked += 1
                continue
            else:
                loss, g, metric_loss = val
                exp_loss, exp_g = dpo_refs[key[2:]]
                sp = MESHES[key[0]][0]
                # metrics["loss"]: mean over this dp rank's pairs; dp ranks hold equal numbers of pairs
                dp_means = [results[r][key][2] for r in range(0, world, sp)]
                assert abs(sum(dp_means) / len(dp_means) - exp_loss) < 1e-5, key
            assert abs(loss - exp_loss) <= TOL["atol"] + TOL["rtol"] * abs(exp_loss), (key, rank, loss, exp_loss)
            for n, t in exp_g.items():
                torch.testing.assert_close(g[n], t, **TOL, msg=lambda m, n=n, k=key, r=rank: f"{k} rank {r} {n}: {m}")
            checked += 1
    assert checked == sum(len(r) for r in results)


def test_losses_and_grads_match_reference_world4():
    results = run_distributed(_world_worker, 4, WORLD4, timeout=150)
    check_world(results, 4)


@pytest.mark.slow
def test_losses_and_grads_match_reference_sp3():
    results = run_distributed(_world_worker, 3, ["ring3", "uly3"], timeout=150)
    check_world(results, 3)


def _many_tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    big = 1 << 16
    return [torch.randn(big + 5, generator=g),  # large: reduced in place
            torch.randn(300, big // 256, generator=g).t(),  # large but strided: through the buffer
            torch.randn(7, generator=g), torch.randn(3, 4, generator=g).to(torch.bfloat16),  # small, two dtypes
            torch.randn(big, generator=g, dtype=torch.float64), torch.zeros(0)]


def _many_worker() -> list[torch.Tensor]:
    import torch.distributed as dist

    from seqpar import comm

    ts = _many_tensors(dist.get_rank())
    views = [t for t in ts]  # the very objects must be updated in place
    comm.all_reduce_many_(ts, dist.group.WORLD, device=torch.device("cpu"))
    assert all(a is b for a, b in zip(ts, views))
    return ts


def test_all_reduce_many_sums_in_place_world3():
    """Every tensor (large/in place, strided, small fp32/bf16, fp64, empty) equals the sum of the 3 ranks'
    values, computed here without communication; exact up to fp32 summation order (bf16: its rounding)."""
    results = run_distributed(_many_worker, 3, timeout=120)
    want = [sum(t.double() for t in ts) for ts in zip(*(_many_tensors(r) for r in range(3)))]
    for got in results:
        for g, w in zip(got, want):
            tol = 2e-2 if g.dtype == torch.bfloat16 else 1e-5
            assert g.shape == w.shape and g.dtype in (torch.float32, torch.float64, torch.bfloat16)
            torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- single process
def test_chunked_ce_equals_plain_and_never_holds_all_logits():
    vocab = 500
    model = Tiny(3, vocab)
    torch.manual_seed(4)
    ids = torch.randint(1, vocab, (2, 40))
    pos = torch.arange(40).expand(2, 40)
    y = torch.randint(0, vocab, (2, 40))
    y[0, :10] = IGN
    y[1, 25:] = IGN
    n = int((y != IGN).sum())
    plain = sft_loss(model(ids, pos), y, n)
    plain.backward()
    g_plain = grads(model)
    model.zero_grad(set_to_none=True)

    saved = []
    calls = {"n": 0}
    model.head.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked = sft_loss(None, y, n, hidden=model.hidden(ids, pos), lm_head=model.head, chunk_size=7)
    n_chunks = math.ceil(n / 7)
    assert calls["n"] == n_chunks
    chunked.backward()
    assert calls["n"] == 2 * n_chunks  # each chunk's logits recomputed in backward (checkpoint)
    torch.testing.assert_close(chunked, plain, **TOL)
    for k, t in g_plain.items():
        torch.testing.assert_close(grads(model)[k], t, **TOL)
    # Everything kept for backward is far smaller than the supervised tokens' full-vocab logits.
    assert sum(saved) < n * vocab / 4, (sum(saved), n * vocab)


def test_sequence_logps_chunked_equals_plain_single_process():
    model = Tiny(2)
    ids = torch.randint(1, V, (3, 12))
    pos = torch.arange(12).expand(3, 12)
    y = torch.randint(0, V, (3, 12))
    y[1] = IGN
    a, ca = sequence_logps(model(ids, pos), y, None)
    b, cb = sequence_logps(None, y, None, hidden=model.hidden(ids, pos), lm_head=model.head, chunk_size=4)
    torch.testing.assert_close(a, b, **TOL)
    assert ca.tolist() == cb.tolist() == [12, 0, 12] and a[1] == 0
    ref = torch.log_softmax(model(ids, pos), -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(a, (ref * (y != IGN)).sum(1), **TOL)


@pytest.mark.parametrize("chunked", [False, True])
def test_zero_supervised_is_finite_with_zero_grad(chunked):
    model = Tiny(0)
    ids = torch.randint(1, V, (1, 8))
    pos = torch.arange(8)[None]
    y = torch.full((1, 8), IGN)
    if chunked:
        loss = sft_loss(None, y, 0, hidden=model.hidden(ids, pos), lm_head=model.head)
    else:
        loss = sft_loss(model(ids, pos), y, torch.tensor(0))
    loss.backward()
    assert loss.item() == 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None and (p.grad == 0).all(), name  # defined (DDP needs it) and zero
    lp, cnt = sequence_logps(model(ids, pos), y, None)
    share, metrics = dpo_loss(lp, lp, lp.detach(), lp.detach(), loss_type="ipo", chosen_counts=cnt,
                              rejected_counts=cnt)
    assert torch.isfinite(share) and all(torch.isfinite(v) for v in metrics.values())


def test_bad_loss_inputs_raise():
    logits = torch.randn(1, 4, V)
    with pytest.raises(seqpar.SeqParError, match="exactly one"):
        sft_loss(logits, torch.zeros(1, 4, dtype=torch.long), 1, hidden=torch.randn(1, 4, H), lm_head=lambda h: h)
    with pytest.raises(seqpar.SeqParError, match="lm_head"):
        sft_loss(None, torch.zeros(1, 4, dtype=torch.long), 1, hidden=torch.randn(1, 4, H))
    with pytest.raises(seqpar.SeqParError, match="shift_labels"):
        sft_loss(logits, torch.zeros(1, 5, dtype=torch.long), 1)
    with pytest.raises(seqpar.SeqParError, match="mesh"):
        sft_loss(logits, torch.zeros(1, 4, dtype=torch.long), None)
    x = torch.zeros(2)
    with pytest.raises(seqpar.SeqParError, match="loss_type"):
        dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(seqpar.SeqParError, match="ref_chosen"):
        dpo_loss(x, x, loss_type="sigmoid")
    with pytest.raises(seqpar.SeqParError, match="counts"):
        dpo_loss(x, x, loss_type="simpo")
    with pytest.raises(seqpar.SeqParError, match="equal shape"):
        dpo_loss(x, torch.zeros(3), x, x)
    assert gradient_reduction_factor(None) == 1.0


def test_bf16_logits_are_upcast():
    torch.manual_seed(0)
    logits = torch.randn(2, 9, V)
    y = torch.randint(0, V, (2, 9))
    y[0, :4] = IGN
    a = sft_loss(logits, y, 14)
    b = sft_loss(logits.bfloat16(), y, 14)
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=2e-2, rtol=1e-2)  # bf16 inputs: only their rounding differs


# ----------------------------------------------------------------------------- the docs example, end to end
def _docs_dataset() -> list[dict]:
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        ids = [rng.randrange(1, 160) for _ in range(rng.randrange(5, 40))]
        rows.append({"input_ids": ids, "labels": [t if rng.random() < 0.7 else IGN for t in ids]})
    return rows


def _docs_loop(sp: int, batch_size: int):
    """The loop of docs/data_and_loss.md section 4 (HF tiny llama, packing, 2 micro-batches, AdamW)."""
    from seqpar.hf import apply_sequence_parallel, tiny_model

    dataset = _docs_dataset()
    model = tiny_model("llama", 4, 2, seed=0)
    mesh = seqpar.init_mesh(sp, model_config=model.config)
    model = apply_sequence_parallel(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    collate = SequenceParallelCollator(mesh, pad_token_id=0, packing=True, max_length=8192)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=collate,
                                         sampler=seqpar.data.sp_sampler(len(dataset), mesh, seed=0))
    accum, micro, losses = 2, [], []
    for batch in loader:
        micro.append(batch)
        if len(micro) < accum:
            continue
        n = global_token_count(sum(b["num_supervised_tokens"] for b in micro), mesh)
        total = torch.zeros(())
        for b in micro:
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                           cu_seqlens=b["cu_seqlens"]).logits
            loss = sft_loss(logits, b["shift_labels"], n)
            loss.backward()
            total += loss.detach()
        sum_gradients(model.parameters(), mesh)
        opt.step()
        opt.zero_grad()
        micro = []
        losses.append(float(global_loss(total, mesh)))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_docs_training_loop_matches_single_process():
    """dp=2 x sp=2 (2 rows per dp rank) vs one process (4 rows): the same rows per step, so the
    same losses and weights after 2 AdamW steps. Tolerance fp32: loss 1e-5, weights 2e-5."""
    results = run_distributed(_docs_loop, 4, 2, 2, timeout=300)
    ref_losses, ref_w = _docs_loop(1, 4)
    assert len(ref_losses) == 2
    for losses, w in results:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
        for k, t in ref_w.items():
            torch.testing.assert_close(w[k], t, atol=2e-5, rtol=1e-5)
