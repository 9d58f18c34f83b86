"""GRPO optimizer step under SP == a single-process GRPO step without SP, loss and EVERY gradient.

One optimizer step = 2 grad-accumulation micro-batches per dp rank, B=2 rows each (prompt unsupervised,
completions of uneven lengths, one row whose completion is entirely cut by the collator's max_length:
no supervised token, must stay finite), advantages of both signs, old log-probs = the current policy's
+ noise (so the clip is active on both sides; garbage -1000 where not supervised, which the loss must
never exponentiate), reference log-probs from a second model (through ReferenceTokenLogps, or
precomputed per token in the batch).

SP side: the shared step (`seqpar.steps.count_items` + `global_token_count` -> `micro_batch_loss`
with StepSpec(stage="grpo")), as both trainers run it, or (direct=True) token_logps + grpo_denominators +
grpo_loss as an RL loop calls them (docs/rl.md); gradients SUMMED over dp x sp.
Reference: the plain (unpatched) fp32 HF model on every row alone, unpadded; log_softmax(logits / T)
at the targets; TRL's per-token formulas written out in plain torch over the full sequences; the
step's global normalisation (grpo: mean of per-sequence means over all sequences of the step; bnpo:
token sum / token count of the step; dr_grpo: token sum / (sequences * max_completion_length)).
Tolerance fp32: 1e-5 absolute on the loss, every parameter gradient and the kl / entropy metrics;
1e-6 on the clip fractions (exact counts, rounding only).
The in-process test checks grpo_loss against TRL's own GRPOTrainer._compute_loss on identical inputs.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from reference import AdapterOff

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelCollator
from seqpar.errors import SeqParError
from seqpar.hf import apply_sequence_parallel, tiny_model
from seqpar.spawn import run_distributed
from seqpar.steps import ReferenceTokenLogps, StepSpec, count_items, micro_batch_loss

TOL = 1e-5
CLIP_TOL = 1e-6
VOCAB = 160
MAX_LEN = 40  # collator max_length: cuts one row's whole completion
MAX_COMPLETION = 24  # dr_grpo's normaliser
CHUNK = 6
MODES = {"ulysses2": (2, 2, 1), "ring2": (2, 1, 2), "usp2x2": (4, 2, 2), "ulysses3": (3, 3, 1), "ring3": (3, 1, 3)}


# ----------------------------------------------------------------------------- data
def _rows(seed: int, n_dp: int) -> list[list[list[dict]]]:
    """rows[dp][micro] = 2 rows {"input_ids", "labels", "adv"}; prompt + completion, uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in range(n_dp):
        micro = []
        for m in range(2):
            rows = []
            for j, (p, c) in enumerate(((7, 14 + 3 * d), (12, 5 + m))):
                if d == 0 and m == 1 and j == 1:
                    p, c = MAX_LEN, 6  # the completion is entirely truncated
                ids = torch.randint(3, VOCAB, (p + c,), generator=g)
                labels = ids.clone()
                labels[:p] = -100
                adv = float(torch.empty(()).uniform_(-1.5, 1.5, generator=g))
                rows.append({"input_ids": ids, "labels": labels, "adv": adv})
            micro.append(rows)
        out.append(micro)
    return out


def _ref_row(model, row, temperature):
    """(token logps [n-1], entropy [n-1], keep [n-1]) of one row truncated as the collator does."""
    ids, labels = row["input_ids"][:MAX_LEN], row["labels"][:MAX_LEN]
    logits = model(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None]).logits[0, :-1]
    logp = torch.log_softmax(logits.double() / temperature, -1)
    tgt = labels[1:]
    keep = tgt != -100
    return logp.gather(1, tgt.clamp(min=0)[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1), keep


# ----------------------------------------------------------------------------- models
def _make(case, seed):
    model = tiny_model(case["arch"], case["hq"], case["hkv"], seed=seed)
    if case["lora"]:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 7)  # identical random A and B in every copy (B != 0: real gradients)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(model, cfg)
    return model


# ----------------------------------------------------------------------------- independent reference
def _reference_step(rows, case, olds):
    """Loss, parameter gradients and per-micro-batch metrics of the step on the plain fp32 model."""
    loss_type, beta, temperature, eps_low, eps_high = case["loss_type"], case["beta"], case["T"], 0.2, case["eps_high"]
    eps_high = eps_low if eps_high is None else eps_high
    policy = _make(case, 0).train()
    ref_model = AdapterOff(policy) if case["lora"] else tiny_model(case["arch"], case["hq"], case["hkv"], seed=1)
    seq_terms, tok_sum, tok_count, n_seq = [], 0.0, 0, 0
    metrics = []
    for m in range(2):
        acc = {"n": 0, "kl": 0.0, "ent": 0.0, "low": 0.0, "high": 0.0, "region": 0.0, "lows": [], "highs": []}
        for d in range(len(rows)):
            for j, row in enumerate(rows[d][m]):
                tok, ent, keep = _ref_row(policy, row, temperature)
                with torch.no_grad():
                    ref_tok, _, _ = _ref_row(ref_model, row, temperature)
                old = olds[d][m][j] if case["old"] else tok.detach()
                a = row["adv"]
                ratio = torch.exp(tok - old)
                per = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
                kl = torch.exp(ref_tok - tok) - (ref_tok - tok) - 1
                if beta:
                    per = per + beta * kl
                per, cnt = per[keep], int(keep.sum())
                seq_terms.append(per.sum() / max(cnt, 1))
                tok_sum, tok_count, n_seq = tok_sum + per.sum(), tok_count + cnt, n_seq + 1
                r = ratio.detach()[keep]
                low, high = (r < 1 - eps_low) & (a < 0), (r > 1 + eps_high) & (a > 0)
                acc["n"] += cnt
                acc["kl"] += float(kl.detach()[keep].sum())
                acc["ent"] += float(ent.detach()[keep].sum())
                acc["low"], acc["high"] = acc["low"] + float(low.sum()), acc["high"] + float(high.sum())
                acc["region"] += float((low | high).sum())
                if cnt:
                    acc["lows"].append(float(low.double().mean()))
                    acc["highs"].append(float(high.double().mean()))
        n = max(acc["n"], 1)
        met = {"clip_ratio/low_mean": acc["low"] / n, "clip_ratio/high_mean": acc["high"] / n,
               "clip_ratio/region_mean": acc["region"] / n, "entropy": acc["ent"] / n,
               "clip_ratio/low_min": min(acc["lows"]), "clip_ratio/high_max": max(acc["highs"])}
        if beta:
            met["kl"] = acc["kl"] / n
        metrics.append(met)
    if loss_type == "grpo":
        loss = torch.stack(seq_terms).sum() / n_seq
    elif loss_type == "bnpo":
        loss = tok_sum / max(tok_count, 1)
    else:
        loss = tok_sum / (n_seq * MAX_COMPLETION)
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for n, p in policy.named_parameters()}
    return float(loss.detach()), grads, metrics, (n_seq, tok_count), policy, ref_model


def _olds(rows, policy, temperature):
    """Per row: the policy's current token log-probs + noise (sd 0.25), the same on every rank."""
    g = torch.Generator().manual_seed(5)
    out = []
    for micro in rows:
        out.append([[(_ref_row(policy, r, temperature)[0].detach()
                      + 0.25 * torch.randn(min(r["input_ids"].numel(), MAX_LEN) - 1, generator=g, dtype=torch.float64))
                     for r in rows_m] for rows_m in micro])
    return out


# ----------------------------------------------------------------------------- SP side
def _full(values: list[torch.Tensor], keep_rows: list[torch.Tensor], shape) -> torch.Tensor:
    """Per-row vectors on the collator's full [B, S_full] layout; -1000 where not supervised (must be masked)."""
    out = torch.full(shape, -1000.0)
    for i, (v, k) in enumerate(zip(values, keep_rows)):
        out[i, : v.numel()] = torch.where(k, v.float(), torch.full_like(v.float(), -1000.0))
    return out


def run_case(mesh, case):
    rows = _rows(11, mesh.dp_size)
    with torch.no_grad():
        probe = _make(case, 0)
        olds = _olds(rows, probe, case["T"])
    want_loss, want_grads, want_metrics, want_counts, _, ref_plain = _reference_step(rows, case, olds)
    policy = apply_sequence_parallel(_make(case, 0), mesh).train()
    reference = None
    if case["lora"] and case["ref"] == "model":  # the policy with its adapter disabled
        reference = ReferenceTokenLogps(policy=policy, fused_loss=case["fused"], loss_chunk_tokens=CHUNK,
                                        temperature=case["T"])
    elif case["ref"] == "model":
        ref_sp = apply_sequence_parallel(tiny_model(case["arch"], case["hq"], case["hkv"], seed=1), mesh).eval()
        reference = ReferenceTokenLogps(ref_model=ref_sp.requires_grad_(False), fused_loss=case["fused"],
                                        loss_chunk_tokens=CHUNK, temperature=case["T"])
    coll = SequenceParallelCollator(mesh, pad_token_id=0, max_length=MAX_LEN)
    micro = []
    for m, rows_m in enumerate(rows[mesh.dp_rank]):
        full = coll.collate_full([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows_m])
        batch = coll.shard_batch(full)
        batch["advantages"] = torch.tensor([r["adv"] for r in rows_m])
        keeps = [_ref_row_keep(r) for r in rows_m]
        if case["old"]:
            batch["old_logps"] = seqpar.shard(_full(olds[mesh.dp_rank][m], keeps, full["shift_labels"].shape), mesh)
        if case["ref"] == "batch":
            with torch.no_grad():
                refs = [_ref_row(ref_plain, r, case["T"])[0] for r in rows_m]
            batch["ref_logps"] = seqpar.shard(_full(refs, keeps, full["shift_labels"].shape), mesh)
        micro.append(batch)
    spec = StepSpec("grpo", case["beta"], case["loss_type"], fused_loss=case["fused"], loss_chunk_tokens=CHUNK,
                    epsilon_low=0.2, epsilon_high=case["eps_high"], max_completion_length=MAX_COMPLETION,
                    temperature=case["T"])
    num_items = L.global_token_count(count_items(micro, "grpo"), mesh)
    den = L.grpo_denominators(micro, mesh, MAX_COMPLETION)
    res = {"counts": int(num_items.tolist() != list(want_counts)) + int([int(den.num_sequences), int(den.num_tokens)]
                                                                       != list(want_counts))}
    total, metrics = 0.0, []
    for b in micro:
        if case["direct"]:  # the RL-loop API of docs/rl.md, without the train step
            out = seqpar.token_logps(policy, b, mesh, entropy=True, temperature=case["T"], chunk_tokens=CHUNK)
            share, met = L.grpo_loss(out.logps, b["advantages"], out.shift_labels, den, old_logps=b.get("old_logps"),
                                     ref_logps=b.get("ref_logps"), beta=case["beta"], epsilon_high=case["eps_high"],
                                     loss_type=case["loss_type"], mesh=mesh, entropy=out.entropy)
        else:
            share, met = micro_batch_loss(policy, b, num_items, mesh, spec, reference)
        share.backward()
        total += float(L.global_loss(share, mesh))
        metrics.append({k: float(v) for k, v in met.items()})
    L.sum_gradients(policy.parameters(), mesh)
    got = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for n, p in policy.named_parameters()}
    res["loss"] = abs(total - want_loss)
    res["finite"] = int(not math.isfinite(total))
    res["grad"] = max(float((got[n] - want_grads[n]).abs().max()) for n in got)
    res["grad_scale"] = max(float(g.abs().max()) for g in want_grads.values())
    res["metric"], res["clip"] = 0.0, 0.0
    for got_m, want_m in zip(metrics, want_metrics):
        if got_m.keys() != want_m.keys():
            res["metric"] = float("inf")
            continue
        for k, v in want_m.items():
            key = "clip" if k.startswith("clip") else "metric"
            res[key] = max(res[key], abs(got_m[k] - v))
    res["clipped"] = want_metrics[0]["clip_ratio/region_mean"] + want_metrics[1]["clip_ratio/region_mean"]
    return res


def _ref_row_keep(row) -> torch.Tensor:
    return row["labels"][:MAX_LEN][1:] != -100


def world_cases(cases):
    meshes, out = {}, []
    for case in cases:
        if case["mode"] not in meshes:
            sp, u, r = MODES[case["mode"]]
            meshes[case["mode"]] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        out.append((case, run_case(meshes[case["mode"]], case)))
    return out


def _case(mode, loss_type, beta, ref="", old=True, fused=True, T=1.0, eps_high=None, arch="llama", hq=4, hkv=2,
          lora=False, direct=False):
    return dict(mode=mode, loss_type=loss_type, beta=beta, ref=ref, old=old, fused=fused, T=T, eps_high=eps_high,
                arch=arch, hq=hq, hkv=hkv, lora=lora, direct=direct)


def _assert(per_rank):
    bad, worst = [], {"loss": 0.0, "grad": 0.0, "metric": 0.0, "clip": 0.0}
    for rank, results in enumerate(per_rank):
        for case, r in results:
            for k in worst:
                worst[k] = max(worst[k], r[k])
            ok = r["loss"] <= TOL and r["grad"] <= TOL and r["metric"] <= TOL and r["clip"] <= CLIP_TOL
            # The test must exercise what it claims: real gradients, and the clip active when old_logps are given.
            ok = ok and r["counts"] == 0 and r["finite"] == 0 and r["grad_scale"] > 1e-3
            ok = ok and (r["clipped"] > 0) == case["old"]
            if not ok:
                bad.append((rank, case, r))
    assert not bad, "GRPO under SP != reference:\n" + "\n".join(map(str, bad))
    print(f"worst errors: {worst}")


# every loss type with beta 0 and 0.04 over the three meshes; sp2 meshes in a 4-rank world are dp2 x sp2
FAST_W4 = [
    _case("ulysses2", "grpo", 0.0, hq=9, hkv=3),
    _case("ulysses2", "bnpo", 0.04, ref="model", T=0.8, eps_high=0.28),
    _case("ring2", "dr_grpo", 0.04, ref="batch", arch="qwen2"),
    _case("ring2", "grpo", 0.04, ref="model", fused=False, T=0.8),
    _case("ring2", "bnpo", 0.04, ref="model", T=0.8, lora=True),
    _case("usp2x2", "bnpo", 0.0, eps_high=0.28, arch="qwen3"),
    _case("usp2x2", "dr_grpo", 0.0, old=False),
    _case("usp2x2", "grpo", 0.04, ref="batch", T=0.8, hq=6, hkv=2),
    _case("ulysses2", "dr_grpo", 0.04, ref="batch", T=0.8, direct=True),
]


def test_grpo_step_world4_fast():
    _assert(run_distributed(world_cases, 4, FAST_W4, timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_grpo_step_more_meshes(world):
    modes = {2: ["ulysses2", "ring2"], 3: ["ulysses3", "ring3"]}[world]
    cases = [_case(m, lt, beta, ref="model" if beta else "", T=0.8 if beta else 1.0, hq=9, hkv=3)
             for m in modes for lt in L.GRPO_LOSS_TYPES for beta in (0.0, 0.04)]
    _assert(run_distributed(world_cases, world, cases, timeout=1800))


# ----------------------------------------------------------------------------- vs TRL's own code, in process
def _trl_loss(loss_type, beta, eps_low, eps_high, logps, entropies, inputs, max_completion_length, kl_corr=False):
    """TRL's GRPOTrainer._compute_loss on a stand-in trainer whose forward returns the given log-probs."""
    from collections import defaultdict

    from trl.trainer.grpo_trainer import GRPOTrainer

    metrics = {"train": defaultdict(list)}
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        args=types.SimpleNamespace(use_bias_correction_kl=kl_corr, delta=None), aux_loss_enabled=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics=metrics, max_completion_length=max_completion_length,
        accelerator=types.SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction="sum": x),
    )
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("loss_type", L.GRPO_LOSS_TYPES)
@pytest.mark.parametrize(("beta", "kl_corr"), [(0.0, False), (0.04, False), (0.04, True)])
def test_grpo_loss_matches_trl_compute_loss(loss_type, beta, kl_corr):
    """One micro-batch, no SP, GA 1: seqpar.loss.grpo_loss == TRL's _compute_loss (loss, d loss / d logps,
    every metric TRL logs for these loss types) at 1e-6 (fp32), incl. a row with no completion token."""
    g = torch.Generator().manual_seed(3)
    b, c = 4, 9
    mask = torch.ones(b, c, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, :] = 0  # completion entirely truncated
    mask[3, 2:] = 0
    logps = (-2.0 * torch.rand(b, c, generator=g)).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(b, c, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(b, c, generator=g)
    ent = torch.rand(b, c, generator=g)
    adv = torch.tensor([0.7, -1.1, 0.4, -0.3])
    inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.zeros(b, c, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref}
    want, want_m = _trl_loss(loss_type, beta, 0.2, 0.28, logps, ent, inputs, c, kl_corr)
    (want_g,) = torch.autograd.grad(want, logps)
    labels = torch.where(mask.bool(), torch.ones_like(mask), torch.full_like(mask, -100))
    den = L.GRPODenominators(torch.tensor(b), mask.sum(), c)
    share, got_m = L.grpo_loss(logps, adv, labels, den, old_logps=old, ref_logps=ref if beta else None, beta=beta,
                               epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type, entropy=ent,
                               kl_ratio_correction=kl_corr)
    (got_g,) = torch.autograd.grad(share, logps)
    assert abs(float(share.detach()) - float(want.detach())) < 1e-6
    assert float((got_g - want_g).abs().max()) < 1e-6
    assert want_m["clip_ratio/region_mean"] > 0  # the clip is active
    assert set(got_m) == set(want_m), (set(got_m), set(want_m))
    for k, v in want_m.items():
        assert abs(float(got_m[k]) - v) < 1e-6, (k, float(got_m[k]), v)


def test_grpo_bad_input_refused():
    """Unsupported or inconsistent input raises SeqParError before any collective (mesh=None here)."""
    labels = torch.tensor([[-100, 5, 6]])
    lp = torch.zeros(1, 3)
    den = L.GRPODenominators(torch.tensor(1), torch.tensor(2), 0)
    with pytest.raises(SeqParError, match="loss_type"):
        L.grpo_loss(lp, torch.zeros(1), labels, den, loss_type="dapo")
    with pytest.raises(SeqParError, match="max_completion_length"):
        L.grpo_loss(lp, torch.zeros(1), labels, den, loss_type="dr_grpo")
    with pytest.raises(SeqParError, match="ref_logps"):
        L.grpo_loss(lp, torch.zeros(1), labels, den, beta=0.1)
    with pytest.raises(SeqParError, match="advantages"):
        L.grpo_loss(lp, torch.zeros(2), labels, den)
    with pytest.raises(SeqParError, match="old_logps"):
        L.grpo_loss(lp, torch.zeros(1), labels, den, old_logps=torch.zeros(1, 4))
    with pytest.raises(SeqParError, match="packing=False"):
        L.grpo_denominators([{"shift_labels": labels, "cu_seqlens": torch.tensor([0, 3])}], None)
    with pytest.raises(SeqParError, match="num_supervised_tokens"):
        count_items([{"shift_labels": labels}], "grpo")
    with pytest.raises(SeqParError, match="num_sequences, num_tokens"):
        L.GRPODenominators.from_counts(torch.tensor(5), 10)
    mesh = seqpar.init_mesh(1)
    with pytest.raises(SeqParError, match="advantages"):
        micro_batch_loss(None, {"shift_labels": labels}, torch.tensor([1, 2]), mesh, StepSpec("grpo", 0.0, "bnpo"))
    # zero supervised tokens anywhere: a finite 0, not NaN
    share, met = L.grpo_loss(lp.requires_grad_(True), torch.ones(1), torch.full((1, 3), -100),
                             L.GRPODenominators(torch.tensor(1), torch.tensor(0), 0), loss_type="grpo")
    share.backward()
    assert float(share) == 0.0 and all(math.isfinite(float(v)) for v in met.values())
    assert float(lp.grad.abs().sum()) == 0.0
