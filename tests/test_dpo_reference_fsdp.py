"""`seqpar train`, DPO full fine-tuning under FSDP2: the frozen reference is sharded over all ranks like the
policy (seqpar.train.model.build.shard_reference), so it costs params/world per rank instead of a whole copy.

The unsharded baseline is the same run with shard_reference disabled (the reference then a plain replica on
every rank, as before): sharding only changes where the reference's weights live, the FSDP2 all-gather is
exact, so losses and parameters after 2 SGD steps must agree to 1e-6 (fp32; seen: bitwise)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from procs import phrase

from seqpar.spawn import run_distributed

TOL = 1e-6  # fp32: the all-gathered reference weights are the very same numbers


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo_ref_fsdp")
    rng = random.Random(3)
    (d / "dpo.jsonl").write_text("".join(json.dumps({"prompt": phrase(rng, 1, 4), "chosen": phrase(rng, 1, 6),
                                                     "rejected": phrase(rng, 2, 7)}) + "\n" for _ in range(8)))
    return d


def _cfg(data, out, sp: int) -> dict:
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(data / "dpo.jsonl"), "max_length": 64},
        "stage": "dpo", "fsdp": True, "seed": 5,
        "sequence_parallel": {"size": sp, "ring_degree": sp} if sp > 1 else 1,
        "micro_batch_size": 1, "grad_accum": 2, "max_steps": 2, "optimizer": {"name": "sgd", "lr": 0.5},
        "checkpoint": {"save_final": True}, "memory": {"measure": True},
        "output_dir": str(out), "progress": False,
    }


def _reference_facts(ref_model: torch.nn.Module) -> dict:
    """What this rank holds of the reference after training: DTensor or not, local and full element counts."""
    from torch.distributed.tensor import DTensor

    ps = list(ref_model.parameters())
    return {"dtensor": [isinstance(p, DTensor) for p in ps],
            "local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in ps),
            "full": sum(p.numel() for p in ps), "itemsize": ps[0].element_size()}


def _world(cases: list[tuple[str, dict, bool]]) -> dict:
    from seqpar.train import run
    from seqpar.train.config import config_from_dict
    from seqpar.train.model import build

    real_finish, real_shard = run.finish, build.shard_reference
    seen: dict = {}

    def spy(loop, result, metrics_path):  # after the last step: the reference the steps used
        seen["ref"] = _reference_facts(loop.reference.ref_model)
        return real_finish(loop, result, metrics_path)

    run.finish = spy
    out = {}
    for key, cfg, shard in cases:
        build.shard_reference = real_shard if shard else (lambda *a, **k: None)
        res = run.train(config_from_dict(cfg))
        state = torch.load(res.final_state_path) if res.final_state_path else None
        out[key] = {"losses": res.losses, "state": state, "ref": seen.pop("ref"),
                    "params_at_peak": [p["by_category"]["Parameter"] for p in res.peak_alloc]}
    build.shard_reference = real_shard
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 1], ids=["sp2_ring", "dp2"])
def test_dpo_fsdp_reference_sharded_matches_unsharded(data, tmp_path, sp):
    """2 ranks (SP=2 ring, or dp=2): DPO + fsdp with the reference sharded vs the same run with it replicated:
    losses and final parameters within 1e-6; the sharded reference's parameters are DTensors after training
    (the root's too: no-grad forwards reshard it) and each rank stores 1/2 of its elements; the memory meter's
    parameter bytes at the peak drop by at least 40% of the reference's size (exactly half of it unless the
    all-gathered layers at the peak differ)."""
    world = 2
    cases = [("sharded", _cfg(data, tmp_path / "sharded", sp), True),
             ("replica", _cfg(data, tmp_path / "replica", sp), False)]
    ranks = run_distributed(_world, world, cases, timeout=600)
    sh, rep = ranks[0]["sharded"], ranks[0]["replica"]
    gap = max(abs(a - b) for a, b in zip(sh["losses"], rep["losses"]))
    diff = max(float((sh["state"][k] - rep["state"][k]).abs().max()) for k in rep["state"])
    assert len(sh["losses"]) == 2 and sh["state"].keys() == rep["state"].keys()
    print(f"sp={sp}: losses {sh['losses']} vs {rep['losses']} (|diff| {gap:.1e}), max |param diff| {diff:.1e}")
    assert gap <= TOL and diff <= TOL
    assert abs(sh["losses"][1] - sh["losses"][0]) > 1e-4  # the policy moved: the comparison sees training
    for r in ranks:
        s, u = r["sharded"]["ref"], r["replica"]["ref"]
        assert all(s["dtensor"]) and not any(u["dtensor"])
        assert s["full"] == u["full"] == u["local"]
        assert abs(s["local"] - s["full"] / world) <= 0.02 * s["full"]  # dim-0 shards: equal up to a row each
        ref_bytes = s["full"] * s["itemsize"]
        drops = [a - b for a, b in zip(r["replica"]["params_at_peak"], r["sharded"]["params_at_peak"])]
        print(f"reference {ref_bytes} B, parameter bytes at the peak dropped by {drops}")
        assert all(d >= 0.4 * ref_bytes * (world - 1) / world for d in drops)
    assert sum(r["sharded"]["ref"]["local"] for r in ranks) == ranks[0]["sharded"]["ref"]["full"]


def test_partly_precomputed_dataset_refused_under_fsdp(data, tmp_path):
    """Fast guard: pairs with and without precomputed reference log-probs under fsdp are refused before any
    collective (a rank whose batch skipped the sharded reference's forward would leave the others waiting);
    LoRA (no frozen copy) and fsdp: false are not concerned."""
    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict
    from seqpar.train.loop.build import refuse_partly_precomputed

    rows = [{"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]} for _ in range(3)]
    pre = [dict(r, ref_chosen_logps=-1.0, ref_rejected_logps=-2.0) for r in rows]
    cfg = config_from_dict(_cfg(data, tmp_path, 1))
    with pytest.raises(SeqParError, match="1 of 3 DPO pairs .* precompute them for every pair or for none"):
        refuse_partly_precomputed(cfg, rows[:2] + pre[:1], [])
    with pytest.raises(SeqParError, match="2 of 4 DPO pairs"):
        refuse_partly_precomputed(cfg, pre[:2], rows[:2])  # eval rows count too
    refuse_partly_precomputed(cfg, pre, pre)
    refuse_partly_precomputed(cfg, rows, rows)
    lora = config_from_dict({**_cfg(data, tmp_path, 1), "finetuning": {"method": "lora", "r": 2, "alpha": 4}})
    refuse_partly_precomputed(lora, rows[:2] + pre[:1], [])
    refuse_partly_precomputed(config_from_dict({**_cfg(data, tmp_path, 1), "fsdp": False}), rows[:2] + pre[:1], [])
