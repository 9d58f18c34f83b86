"""seqpar.rl.token_logps / gather_tokens under SP vs an independent single-process reference.

Reference: the plain (unpatched) HF model run on every row -- every packed document -- separately,
unpadded, then log_softmax(logits / T) gathered at the next token, and the entropy of that
distribution, all by hand. SP: the same rows through SequenceParallelCollator and
token_logps(fused on, several chunks per rank; and fused off), gathered with gather_tokens.

The models are float64 so the comparison tests the algorithm, not fp32 rounding (fp32 SP attention
differs from the plain model by ~1e-6 in the logits already): log-probs / entropy within 1e-10
(measured ~1e-15), gradients of sum(w1 * logps + w2 * entropy) (fixed random weights over the full
sequence, each rank using its shard of them, gradients SUMMED over dp x sp) within 1e-9 (measured
~1e-14; Gemma, whose norms run in fp32 even in fp64 models: 1e-5). fp32 exactness of the same
path is covered by tests/test_grpo_loss.py (1e-5). Gemma3 with final-logit softcapping checks that
the fused head applies the model's transform before the temperature.
Meshes (one spawned world of 4 ranks): dp2 x ulysses2, dp2 x ring2 (zigzag), USP 2x2; the slow
test adds ulysses 3 / ring 3 (P=3) and pure sp2 worlds.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelCollator
from seqpar.errors import SeqParError
from seqpar.hf import apply_sequence_parallel, tiny_model
from seqpar.spawn import run_distributed

VAL_TOL = 1e-10  # log-probs / entropy, fp64 models (measured ~1e-15)
GRAD_TOL = 1e-9  # measured ~1e-14
# Gemma's RMSNorm computes in float32 even in a float64 model (x.float()), so its weight gradients are fp32
# sums over tokens, grouped differently with SP: fp32 rounding (measured 4.9e-7); the fp32 bar applies.
GEMMA_GRAD_TOL = 1e-5
CHUNK = 5
VOCAB = 160
MODES = {"ulysses2": (2, 2, 1), "ring2": (2, 1, 2), "usp2x2": (4, 2, 2), "ulysses3": (3, 3, 1), "ring3": (3, 1, 3)}


def _rows(kind: str, seed: int, n_dp: int) -> list[list[dict]]:
    """Per dp rank: "pad" = B=2 rows of different lengths (prompt unsupervised); "packed" = 3 documents."""
    g = torch.Generator().manual_seed(seed)
    lengths = {"pad": (31, 22), "packed": (13, 9, 17)}[kind]
    out = []
    for d in range(n_dp):
        rows = []
        for n in lengths:
            n += 2 * d
            ids = torch.randint(3, VOCAB, (n,), generator=g)
            labels = ids.clone()
            labels[: int(torch.randint(1, n // 2, (1,), generator=g))] = -100
            rows.append({"input_ids": ids, "labels": labels})
        out.append(rows)
    return out


def _ref_row(model, ids, labels, temperature):
    """(logps [n-1], entropy [n-1], keep [n-1]) of one unpadded document, position p predicting p+1."""
    logits = model(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None]).logits[0, :-1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    tgt = labels[1:]
    keep = tgt != -100
    tok = logp.gather(1, tgt.clamp(min=0)[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return tok, ent, keep


def _full_positions(kind: str, rows: list[dict]) -> list[tuple[int, int, int]]:
    """(row index in the batch, offset in the row) of every document: where the collator puts it."""
    if kind == "packed":
        out, off = [], 0
        for r in rows:
            out.append((0, off, r["input_ids"].numel()))
            off += r["input_ids"].numel()
        return out
    return [(i, 0, r["input_ids"].numel()) for i, r in enumerate(rows)]


def run_case(mesh, arch, hq, hkv, kind, fused, entropy, temperature, seed=0):
    torch.manual_seed(1234)
    # "<arch>+softcap": final-logit softcapping, which the fused head applies before the temperature
    base, _, extra = arch.partition("+")
    kw = {"final_logit_softcapping": 3.0} if extra == "softcap" else {}
    ref = tiny_model(base, hq, hkv, seed=seed, dtype=torch.float64, **kw).train()
    sp = apply_sequence_parallel(tiny_model(base, hq, hkv, seed=seed, dtype=torch.float64, **kw), mesh).train()
    rows = _rows(kind, 7 + seed, mesh.dp_size)
    coll = SequenceParallelCollator(mesh, pad_token_id=0, packing=(kind == "packed"))
    full = coll.collate_full(rows[mesh.dp_rank])
    batch = coll.shard_batch(full)
    g = torch.Generator().manual_seed(99)
    # Fixed weights over every dp rank's full batch (same on all ranks): the backward test's loss.
    b, s_full = full["shift_labels"].shape
    weights = [(torch.randn(b, 128, generator=g, dtype=torch.float64),
                torch.randn(b, 128, generator=g, dtype=torch.float64)) for _ in range(mesh.dp_size)]
    # Reference: the loss sum over all dp ranks' rows, and this dp rank's expected full tensors.
    total = torch.zeros((), dtype=torch.float64)
    want_lp = torch.zeros(full["shift_labels"].shape, dtype=torch.float64)
    want_ent = torch.zeros_like(want_lp)
    for d, rows_d in enumerate(rows):
        w1, w2 = weights[d]
        for (i, off, n), r in zip(_full_positions(kind, rows_d), rows_d):
            tok, ent, keep = _ref_row(ref, r["input_ids"], r["labels"], temperature)
            tok, ent = tok * keep, ent * keep
            total = total + (w1[i, off:off + n - 1] * tok).sum()
            if entropy:
                total = total + (w2[i, off:off + n - 1] * ent).sum()
            if d == mesh.dp_rank:
                want_lp[i, off:off + n - 1] = tok.detach()
                want_ent[i, off:off + n - 1] = ent.detach()
    total.backward()
    out = seqpar.token_logps(sp, batch, mesh, entropy=entropy, temperature=temperature, chunk_tokens=CHUNK,
                             fused=fused)
    w1, w2 = (seqpar.shard(w[:, :s_full], mesh, dim=1) for w in weights[mesh.dp_rank])
    local = (w1 * out.logps).sum() + ((w2 * out.entropy).sum() if entropy else 0.0)
    local.backward()
    L.sum_gradients(sp.parameters(), mesh)
    got_lp = seqpar.gather_tokens(out.logps, mesh)
    res = {"logps": float((got_lp - want_lp).abs().max()),
           "labels": int((out.shift_labels != batch["shift_labels"]).sum())}
    res["entropy"] = float((seqpar.gather_tokens(out.entropy, mesh) - want_ent).abs().max()) if entropy else 0.0
    if entropy != (out.entropy is not None):
        res["entropy"] = float("inf")
    grads = dict(ref.named_parameters())
    res["grad"] = max(float((p.grad - grads[n].grad).abs().max()) for n, p in sp.named_parameters())
    # gather_tokens round trip: full -> shard -> gather is the identity, and gather -> shard gives the shard back.
    x = torch.randn(2, full["input_ids"].shape[1], 3, generator=g)
    back = seqpar.gather_tokens(seqpar.shard(x, mesh, dim=1), mesh)
    res["roundtrip"] = float((back - x).abs().max())
    res["roundtrip"] += float((seqpar.shard(got_lp, mesh, 1) - out.logps.detach()).abs().max())
    res["roundtrip"] += float(seqpar.gather_tokens(out.logps, mesh).requires_grad)  # detached by contract
    return res


def world_cases(cases):
    meshes, out = {}, []
    for mode, *case in cases:
        if mode not in meshes:
            sp, u, r = MODES[mode]
            meshes[mode] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        out.append(((mode, *case), run_case(meshes[mode], *case)))
    return out


def _assert(per_rank):
    bad, worst = [], {"logps": 0.0, "entropy": 0.0, "grad": 0.0, "roundtrip": 0.0}
    for rank, results in enumerate(per_rank):
        for key, r in results:
            for k in worst:
                worst[k] = max(worst[k], r[k])
            grad_tol = GEMMA_GRAD_TOL if key[1].startswith("gemma") else GRAD_TOL
            if not (r["logps"] <= VAL_TOL and r["entropy"] <= VAL_TOL and r["grad"] <= grad_tol
                    and r["roundtrip"] == 0.0 and r["labels"] == 0):
                bad.append((rank, key, r))
    assert not bad, "token_logps SP != reference:\n" + "\n".join(map(str, bad))
    print(f"worst errors: {worst}")


# (mode, arch, q heads, kv heads, kind, fused, entropy, temperature)
FAST_W4 = [
    ("ulysses2", "llama", 4, 2, "pad", True, True, 0.7),
    ("ulysses2", "qwen3", 9, 3, "packed", True, False, 1.0),
    ("ring2", "qwen2", 4, 2, "pad", False, True, 1.3),
    ("ring2", "llama", 4, 2, "packed", True, True, 0.7),
    ("usp2x2", "mistral", 4, 2, "pad", True, True, 0.7),
    ("usp2x2", "llama", 6, 2, "packed", False, False, 1.0),
    ("ring2", "gemma3+softcap", 4, 2, "pad", True, True, 0.7),
]


def test_token_logps_world4_fast():
    _assert(run_distributed(world_cases, 4, FAST_W4, timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_token_logps_more_meshes(world):
    modes = {2: ["ulysses2", "ring2"], 3: ["ulysses3", "ring3"]}[world]
    cases = [(m, "llama", 9, 3, kind, fused, True, t) for m in modes for kind in ("pad", "packed")
             for fused, t in ((True, 0.7), (False, 1.0))]
    _assert(run_distributed(world_cases, world, cases, timeout=900))


def test_chunked_stats_in_process():
    """One process: the chunked head (several chunks, temperature, entropy) vs plain math, values and
    gradients w.r.t. hidden states and head weights, fp64 at 1e-12; bad input refused."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 30, bias=False, dtype=torch.float64)
    labels = torch.randint(0, 30, (2, 11), generator=g)
    labels[0, :4] = -100
    labels[1, 7:] = -100
    nll, ent = L.chunked_token_stats(hidden, labels, head, 3, temperature=0.6, entropy=True)
    logp = torch.log_softmax(head(hidden) / 0.6, -1)
    keep = labels != -100
    want_nll = -logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * keep
    want_ent = -(logp.exp() * logp).sum(-1) * keep
    assert float((nll - want_nll).abs().max().detach()) < 1e-12 and float((ent - want_ent).abs().max().detach()) < 1e-12
    w = torch.randn(2, 11, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((w * nll + ent).sum(), [hidden, head.weight])
    want = torch.autograd.grad((w * want_nll + want_ent).sum(), [hidden, head.weight])
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-12
    plain_nll, plain_ent = L.token_logprob_stats(head(hidden), labels, temperature=0.6, entropy=True)
    assert float((plain_nll - want_nll).abs().max().detach()) < 1e-12
    assert float((plain_ent - want_ent).abs().max().detach()) < 1e-12
    # entropy=False and T=1 is the SFT path: bitwise what chunked_token_nll returns
    assert torch.equal(L.chunked_token_stats(hidden, labels, head, 3)[0], L.chunked_token_nll(hidden, labels, head, 3))
    with pytest.raises(SeqParError, match="temperature"):
        L.chunked_token_stats(hidden, labels, head, 3, temperature=0.0)
    mesh = seqpar.init_mesh(1)
    with pytest.raises(SeqParError, match="shift_labels"):
        seqpar.token_logps(head, {"input_ids": labels}, mesh)
