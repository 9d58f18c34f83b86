"""Model equivalence: an unmodified HF causal LM under seqpar SP == the same model without SP.

For each case the same global batch goes
- through the SP model (seqpar collator -> apply_sequence_parallel model -> seqpar.loss), every rank
  holding its shard, gradients SUMMED over dp x sp (the loss convention), and
- through an independent single-process reference: the plain HF model run on every row (every
  packed document) separately, unpadded, with a hand-written shift / CE / DPO formula.
Compared: loss, every parameter gradient, the logits of every real token, the supervised-token
count. Tolerance: fp32, 1e-5 absolute on loss and gradients, 2e-5 on logits (values ~1-5).

Cases: B>1 with padding, packed rows (B=1, several documents), rows whose supervised tokens all
fall on SP rank 0's shard, DPO sigmoid / IPO / SimPO; awkward heads (14 q / 2 kv at P=4, 9 / 3 at
P=2 and 4); every mode: SP=1, 2 (ulysses, ring), 3, 4 (ulysses), 4 (ring), 2x2 (USP), dp=2 x sp=2.
One spawned world per world size runs many cases; the full arch x mode grid is `slow`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelCollator, SequenceParallelDPOCollator
from seqpar.hf import ARCHS, apply_sequence_parallel, tiny_model
from seqpar.spawn import run_distributed
from seqpar.threaded import run_threaded

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
LOGIT_TOL = 2e-5
VOCAB = 160


# ----------------------------------------------------------------------------- batches
def _rows(kind: str, seed: int, n_dp: int) -> list[list[dict]]:
    """Per dp rank, a list of rows (SFT: {"input_ids", "labels"} / packed docs; DPO: pairs)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in range(n_dp):
        if kind == "pad":  # B=3, different lengths, prompt part unsupervised
            rows = []
            for n in (37 - 3 * d, 22, 29 + d):
                ids = torch.randint(3, VOCAB, (n,), generator=g)
                labels = ids.clone()
                labels[: int(torch.randint(1, n // 2, (1,), generator=g))] = -100
                rows.append({"input_ids": ids, "labels": labels})
        elif kind == "packed":  # documents of one packed row
            rows = []
            for n in (11, 17 + d, 6, 9):
                ids = torch.randint(3, VOCAB, (n,), generator=g)
                labels = ids.clone()
                labels[:2] = -100
                rows.append({"input_ids": ids, "labels": labels})
        elif kind == "oneshard":  # supervised targets only among the first tokens: all on SP rank 0
            rows = []
            for n in (48, 41):
                ids = torch.randint(3, VOCAB, (n,), generator=g)
                labels = torch.full_like(ids, -100)
                labels[1:4] = ids[1:4]
                rows.append({"input_ids": ids, "labels": labels})
        elif kind == "dpo":
            rows = []
            for p, c, r in ((9, 12, 7), (5, 6, 14 + d)):
                rows.append(
                    {
                        "prompt_input_ids": torch.randint(3, VOCAB, (p,), generator=g),
                        "chosen_input_ids": torch.randint(3, VOCAB, (c,), generator=g),
                        "rejected_input_ids": torch.randint(3, VOCAB, (r,), generator=g),
                    }
                )
        else:
            raise ValueError(kind)
        out.append(rows)
    return out


# ----------------------------------------------------------------------------- independent reference
def _ref_doc(model, ids: torch.Tensor, labels: torch.Tensor):
    """Logits [n, V] of one unpadded document and its per-target NLL sum / count / logp sum."""
    pos = torch.arange(ids.numel())[None]
    logits = model(input_ids=ids[None], position_ids=pos).logits[0]
    tgt = labels[1:]
    keep = tgt != -100
    lp = torch.log_softmax(logits[:-1].double(), -1)
    tok = lp[keep].gather(1, tgt[keep][:, None]).squeeze(1)
    return logits, -tok.sum(), int(keep.sum()), tok.sum()


def _ref_sft(model, rows_per_dp):
    total, count, logits = 0.0, 0, []
    for rows in rows_per_dp:
        lg = []
        for r in rows:
            lo, nll, c, _ = _ref_doc(model, r["input_ids"], r["labels"])
            total = total + nll
            count += c
            lg.append(lo.detach())
        logits.append(lg)
    return total / max(count, 1), count, logits


def _dpo_formula(pc, pr, rc, rr, cc, cr, loss_type, beta, gamma):
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * ((pc - rc) - (pr - rr)))
    if loss_type == "ipo":
        return ((pc / cc - rc / cc) - (pr / cr - rr / cr) - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * (pc / cc - pr / cr) - gamma)


def _ref_dpo(policy, ref_model, rows_per_dp, loss_type, beta, gamma):
    losses = []
    for rows in rows_per_dp:
        for r in rows:
            vals = {}
            for side in ("chosen", "rejected"):
                ids = torch.cat([r["prompt_input_ids"], r[f"{side}_input_ids"]])
                labels = ids.clone()
                labels[: r["prompt_input_ids"].numel()] = -100
                _, _, c, lp = _ref_doc(policy, ids, labels)
                with torch.no_grad():
                    _, _, _, rlp = _ref_doc(ref_model, ids, labels)
                vals[side] = (lp, rlp, float(c))
            (pc, rc, cc), (pr, rr, cr) = vals["chosen"], vals["rejected"]
            losses.append(_dpo_formula(pc, pr, rc, rr, cc, cr, loss_type, beta, gamma))
    return torch.stack(losses).mean()


# ----------------------------------------------------------------------------- one case on one rank
def _grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }


def _max_grad_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _check_logits(sp_logits, mesh, kind, ref_logits_dp, batch_full):
    """Max |SP logits - reference logits| over every real token of this dp rank's rows."""
    full = seqpar.unshard(sp_logits.detach(), mesh, 1)
    err = 0.0
    if kind == "packed":
        off = 0
        for lo in ref_logits_dp:
            n = lo.shape[0]
            err = max(err, float((full[0, off : off + n] - lo).abs().max()))
            off += n
    else:
        for i, lo in enumerate(ref_logits_dp):
            err = max(err, float((full[i, : lo.shape[0]] - lo).abs().max()))
    return err


def run_case(mesh, arch, hq, hkv, kind, seed=0, loss_type="sigmoid", train=True):
    """Errors of one case: dict(loss, grad, logits, count) -- SP vs reference, on this rank."""
    policy_ref = tiny_model(arch, hq, hkv, seed=seed)
    policy_sp = apply_sequence_parallel(tiny_model(arch, hq, hkv, seed=seed), mesh)
    policy_sp.train(train)
    policy_ref.train(train)
    rows = _rows(kind, 100 + seed, mesh.dp_size)
    mine = rows[mesh.dp_rank]
    res = {}
    if kind == "dpo":
        beta, gamma = 0.5, 0.3
        ref_model = tiny_model(arch, hq, hkv, seed=seed + 1).eval()
        ref_sp = apply_sequence_parallel(tiny_model(arch, hq, hkv, seed=seed + 1), mesh).eval()
        want = _ref_dpo(policy_ref, ref_model, rows, loss_type, beta, gamma)
        want.backward()
        coll = SequenceParallelDPOCollator(mesh, pad_token_id=0)
        batch = coll(mine)
        fwd = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        logps, counts = L.sequence_logps(policy_sp(**fwd).logits, batch["shift_labels"], mesh)
        with torch.no_grad():
            rlogps, _ = L.sequence_logps(ref_sp(**fwd).logits, batch["shift_labels"], mesh)
        b = logps.shape[0] // 2
        share, _ = L.dpo_loss(
            logps[:b], logps[b:], rlogps[:b], rlogps[b:], beta=beta, loss_type=loss_type,
            chosen_counts=counts[:b], rejected_counts=counts[b:], gamma=gamma, mesh=mesh,
            num_pairs=L.global_token_count(batch["num_pairs"], mesh),
        )
        share.backward()
        got = L.global_loss(share, mesh)
        res["count"] = 0
    else:
        want, count, ref_logits = _ref_sft(policy_ref, rows)
        want.backward()
        coll = SequenceParallelCollator(mesh, pad_token_id=0, packing=(kind == "packed"))
        batch = coll(mine)
        kw = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        if "cu_seqlens" in batch:
            kw["cu_seqlens"] = batch["cu_seqlens"]
        logits = policy_sp(**kw).logits
        num = L.global_token_count(batch["num_supervised_tokens"], mesh)
        share = L.sft_loss(logits, batch["shift_labels"], num)
        share.backward()
        got = L.global_loss(share, mesh)
        res["count"] = abs(int(num) - count)
        res["logits"] = _check_logits(logits, mesh, kind, ref_logits[mesh.dp_rank], batch)
    L.sum_gradients(policy_sp.parameters(), mesh)
    res["loss"] = abs(float(got) - float(want.detach()))
    res["grad"] = _max_grad_diff(_grads(policy_sp), _grads(policy_ref))
    res["value"] = float(want.detach())
    return res


# ----------------------------------------------------------------------------- worlds
# mode name -> (sp, ulysses, ring); dp = world // sp
MODES = {
    "sp1": (1, 1, 1),
    "ulysses2": (2, 2, 1),
    "ring2": (2, 1, 2),
    "ring3": (3, 1, 3),
    "ulysses3": (3, 3, 1),
    "ulysses4": (4, 4, 1),
    "ring4": (4, 1, 4),
    "usp2x2": (4, 2, 2),
    "dp2xring2": (2, 1, 2),
    "dp2xulysses2": (2, 2, 1),
}


def world_cases(cases):
    """Run cases [(mode, arch, hq, hkv, kind, loss_type)] in this world; meshes built once per mode."""
    meshes, out = {}, []
    for mode, arch, hq, hkv, kind, loss_type in cases:
        if mode not in meshes:
            sp, u, r = MODES[mode]
            meshes[mode] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        res = run_case(meshes[mode], arch, hq, hkv, kind, loss_type=loss_type)
        out.append(((mode, arch, hq, hkv, kind, loss_type), res))
    return out


def _assert_results(per_rank):
    bad = []
    for rank, results in enumerate(per_rank):
        for key, r in results:
            ok = r["loss"] <= LOSS_TOL and r["grad"] <= GRAD_TOL and r.get("logits", 0.0) <= LOGIT_TOL
            if not (ok and r["count"] == 0):
                bad.append((rank, key, r))
    assert not bad, "SP != no-SP:\n" + "\n".join(map(str, bad))
    every = [r for results in per_rank for _, r in results]
    worst = {k: max(r.get(k, 0.0) for r in every) for k in ("loss", "grad", "logits")}
    print(f"{len(every)} case-ranks, worst errors: {worst}")  # shown with pytest -s


HEADS_P2 = [(9, 3), (4, 2)]
HEADS_P4 = [(14, 2), (9, 3)]

# A representative fast subset: every arch, every mode, every batch kind, awkward heads.
FAST_W2 = [
    ("ulysses2", "llama", 9, 3, "pad", ""),
    ("ulysses2", "qwen3", 14, 2, "packed", ""),
    ("ring2", "mistral", 9, 3, "oneshard", ""),
    ("ring2", "gemma3", 4, 2, "dpo", "sigmoid"),
]
FAST_W4 = [
    ("ulysses4", "qwen2", 14, 2, "pad", ""),
    ("ring4", "llama", 14, 2, "packed", ""),
    ("usp2x2", "phi3", 9, 3, "pad", ""),
    ("usp2x2", "gemma2", 4, 2, "dpo", "ipo"),
    ("dp2xring2", "qwen3", 9, 3, "packed", ""),
    ("dp2xulysses2", "llama", 4, 2, "dpo", "simpo"),
]
FAST_W3 = [("ring3", "llama", 9, 3, "pad", "")]
KINDS = [("pad", ""), ("packed", ""), ("oneshard", ""), ("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "simpo")]


@pytest.fixture
def one_thread():
    """The machine is shared: 1 intra-op thread is far faster than contended threads for tiny models."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_sp1_all_archs_in_process(one_thread):
    """SP=1 (no process group): every arch and batch kind, train mode."""
    mesh = seqpar.init_mesh(1)
    results = [
        ((a, kind, lt), run_case(mesh, a, 9, 3, kind, loss_type=lt))
        for a in ARCHS
        for kind, lt in [("pad", ""), ("packed", ""), ("dpo", "simpo")]
    ]
    _assert_results([results])


def test_equivalence_world2_fast():
    _assert_results(run_distributed(world_cases, 2, FAST_W2, timeout=240))


def test_equivalence_world3_fast():
    _assert_results(run_threaded(world_cases, 3, FAST_W3, timeout=240))


def test_equivalence_world4_fast():
    _assert_results(run_threaded(world_cases, 4, FAST_W4, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_equivalence_full_grid(world):
    modes = {
        2: ["ulysses2", "ring2"],
        3: ["ring3", "ulysses3"],
        4: ["ulysses4", "ring4", "usp2x2", "dp2xring2", "dp2xulysses2"],
    }[world]
    heads = {2: [(9, 3), (4, 2)], 3: [(9, 3)], 4: [(14, 2), (9, 3)]}[world]
    # Every arch x kind per mode; the head configuration alternates with the arch.
    cases = [
        (m, a, *heads[(i + j) % len(heads)], kind, lt)
        for m in modes
        for i, a in enumerate(ARCHS)
        for j, (kind, lt) in enumerate(KINDS)
    ]
    _assert_results(run_distributed(world_cases, world, cases, timeout=3000))
