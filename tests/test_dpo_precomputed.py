"""DPO/IPO with precomputed reference log-probs (rows carry ref_chosen_logps / ref_rejected_logps).

The reference sums are computed here by hand with the plain (unpatched) HF reference model in one
process. Under SP=2 (ring), `micro_batch_loss` on a batch carrying them must give the same loss
and parameter gradients (summed over the SP ranks) as (a) the same call with a frozen SP reference
model and (b) an independent single-process DPO written from the formulas. fp32, 1e-5 abs + rel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelDPOCollator
from seqpar.hf import apply_sequence_parallel, tiny_model
from seqpar.spawn import run_distributed
from seqpar.steps import ReferenceLogps, StepSpec, micro_batch_loss

TOL = dict(atol=1e-5, rtol=1e-5)
ARCH, HQ, HKV = "llama", 4, 2
BETA, GAMMA = 0.5, 0.3


def _pairs() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(1, 100, (n,), generator=g).tolist()  # noqa: E731
    # awkward lengths: odd, unequal prompts and completions (padding + zigzag boundaries)
    return [
        {"prompt_input_ids": ids(5), "chosen_input_ids": ids(9), "rejected_input_ids": ids(3)},
        {"prompt_input_ids": ids(2), "chosen_input_ids": ids(4), "rejected_input_ids": ids(11)},
        {"prompt_input_ids": ids(7), "chosen_input_ids": ids(1), "rejected_input_ids": ids(6)},
    ]


def _seq_logp(model: torch.nn.Module, prompt: list[int], comp: list[int]) -> tuple[torch.Tensor, int]:
    """Sum of log p(completion token | prefix) over the full completion, plain HF model, no SP."""
    ids = torch.tensor([prompt + comp])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    targets = torch.tensor(comp)
    return logp[len(prompt) - 1 : len(prompt) - 1 + len(comp)].gather(-1, targets[:, None]).sum(), len(comp)


def _with_precomputed(pairs: list[dict], ref: torch.nn.Module) -> list[dict]:
    out = []
    with torch.no_grad():
        for p in pairs:
            rc, _ = _seq_logp(ref, p["prompt_input_ids"], p["chosen_input_ids"])
            rr, _ = _seq_logp(ref, p["prompt_input_ids"], p["rejected_input_ids"])
            out.append({**p, "ref_chosen_logps": float(rc), "ref_rejected_logps": float(rr)})
    return out


def _single_process(pairs: list[dict], loss_type: str) -> tuple[float, dict[str, torch.Tensor]]:
    policy, ref = tiny_model(ARCH, HQ, HKV, seed=0), tiny_model(ARCH, HQ, HKV, seed=1).eval()
    losses = []
    for p in pairs:
        pc, nc = _seq_logp(policy, p["prompt_input_ids"], p["chosen_input_ids"])
        pr, nr = _seq_logp(policy, p["prompt_input_ids"], p["rejected_input_ids"])
        with torch.no_grad():
            rc, _ = _seq_logp(ref, p["prompt_input_ids"], p["chosen_input_ids"])
            rr, _ = _seq_logp(ref, p["prompt_input_ids"], p["rejected_input_ids"])
        if loss_type == "sigmoid":
            losses.append(-F.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
        else:  # ipo: length-normalised log-ratios
            losses.append(((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * BETA)) ** 2)
    loss = torch.stack(losses).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in policy.named_parameters()}


def _sp_step(mesh, rows, loss_type: str, reference) -> tuple[float, dict[str, torch.Tensor]]:
    policy = apply_sequence_parallel(tiny_model(ARCH, HQ, HKV, seed=0), mesh)
    batch = SequenceParallelDPOCollator(mesh, pad_token_id=0)(rows)
    num = L.global_token_count(batch["num_pairs"], mesh)
    share, _ = micro_batch_loss(policy, batch, num, mesh, StepSpec("dpo", beta=BETA, loss_type=loss_type), reference)
    share.backward()
    L.sum_gradients(policy.parameters(), mesh)
    return float(L.global_loss(share, mesh)), {n: p.grad.clone() for n, p in policy.named_parameters()}


def _never_called(batch):
    raise AssertionError("the reference model must not run when the batch carries ref_logps")


def _worker() -> dict:
    mesh = seqpar.init_mesh(2, ring_degree=2, ulysses_degree=1)
    pairs = _pairs()
    rows = _with_precomputed(pairs, tiny_model(ARCH, HQ, HKV, seed=1).eval())
    batch = SequenceParallelDPOCollator(mesh, pad_token_id=0)(rows)
    out: dict = {"ref_logps": batch["ref_logps"], "ref_dtype": batch["ref_logps"].dtype}
    ref_sp = apply_sequence_parallel(tiny_model(ARCH, HQ, HKV, seed=1), mesh).eval()
    for lt in ("sigmoid", "ipo"):
        out[lt] = {
            "frozen": _sp_step(mesh, pairs, lt, ReferenceLogps(mesh, ref_model=ref_sp)),
            "precomputed": _sp_step(mesh, rows, lt, None),
            "precomputed_pref": _sp_step(mesh, rows, lt, _never_called),
        }
    return out


def test_precomputed_ref_logps_match_frozen_reference_sp2_ring():
    results = run_distributed(_worker, 2, timeout=240)
    pairs = _pairs()
    rows = _with_precomputed(pairs, tiny_model(ARCH, HQ, HKV, seed=1).eval())
    want_ref = torch.tensor([r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows])
    expected = {lt: _single_process(pairs, lt) for lt in ("sigmoid", "ipo")}
    for res in results:
        assert res["ref_dtype"] == torch.float32
        # The rows' precomputed values travel unchanged: bitwise equal on every SP rank; vs this process's
        # own recomputation (other thread count, other fp32 summation order) within 1e-5.
        torch.testing.assert_close(res["ref_logps"], results[0]["ref_logps"], atol=0, rtol=0)
        torch.testing.assert_close(res["ref_logps"], want_ref.float(), atol=1e-5, rtol=0)
        for lt, (exp_loss, exp_g) in expected.items():
            for mode, (loss, g) in res[lt].items():
                assert abs(loss - exp_loss) <= 1e-5 + 1e-5 * abs(exp_loss), (lt, mode, loss, exp_loss)
                for n, t in exp_g.items():
                    torch.testing.assert_close(g[n], t, **TOL, msg=lambda m, k=f"{lt}/{mode}/{n}": f"{k}: {m}")
            # precomputed vs frozen-model path directly, too
            for n, t in res[lt]["frozen"][1].items():
                torch.testing.assert_close(res[lt]["precomputed"][1][n], t, **TOL)


def test_precomputed_ref_logps_bad_input_raises():
    mesh = seqpar.init_mesh(1)
    pairs = _pairs()
    full = [{**p, "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.5} for p in pairs]
    coll = SequenceParallelDPOCollator(mesh, pad_token_id=0)
    assert coll(full)["ref_logps"].tolist() == [-3.0] * 3 + [-4.5] * 3
    assert "ref_logps" not in coll(pairs)
    with pytest.raises(seqpar.SeqParError, match=r"pairs \[1\] lack ref_chosen_logps"):
        coll([full[0], pairs[1], full[2]])
    with pytest.raises(seqpar.SeqParError, match="lack ref_chosen_logps"):  # only one of the two keys
        coll([{**pairs[0], "ref_chosen_logps": -1.0}, full[1]])
    with pytest.raises(seqpar.SeqParError, match="finite float"):
        coll([{**full[0], "ref_rejected_logps": float("nan")}])
    with pytest.raises(seqpar.SeqParError, match="max_length"):  # sums describe the untruncated completion
        SequenceParallelDPOCollator(mesh, pad_token_id=0, max_length=8)(full)
    policy = apply_sequence_parallel(tiny_model(ARCH, HQ, HKV, seed=0), mesh)
    with pytest.raises(seqpar.SeqParError, match="precomputed"):  # neither reference nor ref_logps
        micro_batch_loss(policy, coll(pairs), torch.tensor(3), mesh, StepSpec("dpo"), None)
    bad = coll(full)
    bad["ref_logps"] = bad["ref_logps"][:4]
    with pytest.raises(seqpar.SeqParError, match="ref_logps"):
        micro_batch_loss(policy, bad, torch.tensor(3), mesh, StepSpec("dpo"), None)
    # simpo ignores them (and needs no reference)
    share, _ = micro_batch_loss(policy, coll(full), torch.tensor(3), mesh, StepSpec("dpo", loss_type="simpo"), None)
    assert torch.isfinite(share)
