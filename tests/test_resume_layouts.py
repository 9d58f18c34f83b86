"""Resume anywhere (`seqpar train`): a checkpoint written at one layout continues at another on the uninterrupted
run's trajectory.

Each case trains N = 2 steps at layout A, then M = 2 more at layout B from A's checkpoint-2 (same output_dir, a
new launch), against ONE uninterrupted run of 4 steps in this process at SP = 1 (world 1, dp 1). Every config
sets global_batch_size (4 rows), so grad_accum follows each layout's dp and every step has the same global
batch; seqpar's loss is normalised over the global token count and SP is exact, so the steps must agree.
Compared, fp32: every step's loss and gradient norm (before clipping; relative where it is above 1: DPO's are
~20) within 1e-5, and every final parameter
(final_state.pt) within 1e-5. 6 rows and 4 per step: step 2 reads rows of epoch 0 and of epoch 1 (reshuffled),
so the resume point is a mid-epoch data position. The learning rate warms up over 3 steps (a constant schedule,
so the first launch's max_steps = 2 does not change it): the resumed schedule is mid-warmup. The resumed launch
must say what changed. AdamW runs at lr 1e-3: it turns a gradient element's rounding into an update error of up
to lr x drounding / eps where the element is near eps, so between layouts its parameters agree only to ~lr x
5e-3 (an uninterrupted SP 4 run vs SP 1 at lr 1e-2: 5.6e-5, the same as the resumed one); SGD cases run at lr 0.5.

fast: 4 ranks (SP 4 = ulysses 2 x ring 2, AdamW) -> 2 ranks (SP 1 x dp 2, FSDP2 on): world, SP, dp and FSDP2
change at once; GRPO at SP 2 (dp 1) -> SP 1 x dp 2 (sampling seeded by each prompt's position in the global
batch: the same completions at any dp); `seqpar check` on the output_dir between the launches says what the
resume will do, and `seqpar export` of the 4-rank checkpoint gives the reference's step-2 weights.
slow: SP 4 -> SP 2 x dp 2 (4 ranks), ring 2 -> ulysses 2 (SGD), FSDP2 off -> on, 2 ranks -> 4, DPO (SP 2 ->
SP 1 x dp 2), and a global batch that changes (announced; continues from the right row).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import pytest
import torch
from procs import phrase

from seqpar.spawn import run_distributed

TOL = 1e-5
STEPS, SPLIT = 4, 2


def _write_data(folder: Path, stage: str) -> Path:
    rng = random.Random(3)
    path = folder / f"{stage}.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            if stage == "dpo":
                row = {"prompt": phrase(rng, 1, 5), "chosen": phrase(rng, 1, 6), "rejected": phrase(rng, 2, 8)}
            elif stage == "grpo":
                row = {"prompt": phrase(rng, 1, 3), "answer": "abcdef"[i]}
            else:
                row = {"instruction": phrase(rng, 1, 6), "response": phrase(rng, 2, 10)}
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("resume_layouts")
    return {s: _write_data(d, s) for s in ("sft", "dpo", "grpo")}


def _cfg(data: dict[str, Path], out: Path, stage: str = "sft", sp: dict | int = 1, **over) -> dict:
    cfg = {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
           "dataset": {"path": str(data[stage]), "max_length": 64}, "stage": stage, "sequence_parallel": sp,
           "micro_batch_size": 1, "global_batch_size": 4, "max_steps": STEPS, "optimizer": {"lr": 1e-3},
           "schedule": {"name": "constant", "warmup_steps": 3}, "checkpoint": {"every": SPLIT, "save_final": True},
           "export": {"final": False}, "memory": {"measure": False}, "output_dir": str(out), "progress": False}
    if stage == "grpo":  # 4 completion rows per step = 2 prompts x 2 generations; seed 9: rewards differ
        cfg.update(micro_batch_size=2, seed=9, optimizer={"name": "sgd", "lr": 0.5},
                   dataset={"path": str(data[stage]), "max_length": 48},
                   grpo={"reward_funcs": ["seqpar:length", "seqpar:contains"], "num_generations": 2,
                         "max_prompt_length": 24, "max_completion_length": 12, "temperature": 0.7, "beta": 0.04})
    cfg.update(over)
    return cfg


def _phases(cfgs: list[dict]) -> list[dict]:
    """Train each config in turn in this world; rank 0 also returns what the run printed."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    out = []
    for c in cfgs:
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            res = train(config_from_dict(c))
        out.append({"losses": res.losses, "said": said.getvalue(), "mesh": res.mesh})
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _reference(cfg: dict, out: Path) -> Path:
    """The uninterrupted run: SP = 1, one process, no FSDP (this process)."""
    ref = dict(cfg, sequence_parallel=1, fsdp=False, output_dir=str(out))
    _phases([ref])
    return out


def _compare(name: str, got: Path, want: Path) -> dict[str, float]:
    a, b = _rows(got), _rows(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1)), (name, a, b)
    dloss = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    dgn = max(abs(x["grad_norm"] - y["grad_norm"]) / max(1.0, y["grad_norm"]) for x, y in zip(a, b))
    s, r = torch.load(got / "final_state.pt"), torch.load(want / "final_state.pt")
    assert set(s) == set(r), name
    dparam = max(float((s[k].float() - r[k].float()).abs().max()) for k in r)
    moved = max(float((r[k] - v).abs().max()) for k, v in _init_params(want).items())
    print(f"{name}: max |dloss| {dloss:.2e}, max rel |dgrad_norm| {dgn:.2e}, max |dparam| {dparam:.2e} "
          f"(the reference moved {moved:.2e})")
    assert dloss <= TOL and dgn <= TOL and dparam <= TOL, (name, dloss, dgn, dparam)
    assert moved > 1e-3  # the steps changed the parameters: the comparison is not vacuous
    return {"dloss": dloss, "dgrad_norm": dgn, "dparam": dparam}


def _init_params(out: Path) -> dict[str, torch.Tensor]:
    from seqpar.train.config import config_from_dict
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(json.loads((out / "config.json").read_text()))
    torch.manual_seed(cfg.seed)
    return {k: v.detach() for k, v in load_model(cfg).named_parameters()}


def _check_says(cfg: dict, nproc: int, capsys) -> str:
    """`seqpar check CONFIG --nproc-per-node N` in this process: its output (exit code 0)."""
    import yaml

    from seqpar.cli.main import main

    path = Path(cfg["output_dir"]).with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["check", str(path), "--nproc-per-node", str(nproc)]) == 0
    return capsys.readouterr().out


def test_resume_on_another_layout_fast(data, tmp_path, capsys):
    """4 ranks SP 4 (AdamW) -> 2 ranks SP 1 x dp 2 with FSDP2; GRPO SP 2 -> SP 1 x dp 2 (SGD); check and export
    between the launches (module docstring)."""
    sft = _cfg(data, tmp_path / "sft", sp=4)
    grpo = _cfg(data, tmp_path / "grpo", "grpo", sp=2)
    first = run_distributed(_phases, 4, [dict(sft, max_steps=SPLIT)], timeout=600)[0][0]
    assert "ulysses=2" in first["mesh"] and "ring=2" in first["mesh"], first["mesh"]
    sft_b = dict(sft, sequence_parallel=1, fsdp=True)
    said = _check_says(sft_b, 2, capsys)  # what the next launch will do, before it runs
    assert "resumes from step 2" in said and "world 4 (dp 1 x sp 4: ulysses 2 x ring 2), this run is world 2 " \
           "(dp 2 x sp 1, FSDP2)" in said and "global batch kept: 4 examples per step" in said, said
    assert "the data continues at row 8 (epoch 1: 2 of its 6 examples done)" in said, said
    grpo_b = dict(grpo, sequence_parallel=1)
    second = run_distributed(_phases, 2, [sft_b, dict(grpo, max_steps=SPLIT), grpo_b], timeout=900)[0]
    assert "this run is world 2 (dp 2 x sp 1, FSDP2)" in second[0]["said"], second[0]["said"]
    assert "global batch kept: 2 prompts per step" in second[2]["said"], second[2]["said"]
    ref = _reference(sft, tmp_path / "sft_ref")
    _compare("sft 4 ranks sp4 -> 2 ranks dp2 fsdp", tmp_path / "sft", ref)
    _compare("grpo sp2 -> sp1 x dp2", tmp_path / "grpo", _reference(grpo, tmp_path / "grpo_ref"))
    _export_matches(tmp_path / "sft" / "checkpoint-2", ref / "checkpoint-2", tmp_path)


def _export_matches(ckpt: Path, ref_ckpt: Path, tmp_path: Path) -> None:
    """`seqpar export` of a checkpoint written at another layout (here: 4 ranks, SP 4) gives the weights the
    reference's checkpoint of the same step exports (1e-5)."""
    from safetensors.torch import load_file

    from seqpar.train.lifecycle.export import export_checkpoint

    a = load_file(str(export_checkpoint(ckpt, tmp_path / "export_a") / "model.safetensors"))
    b = load_file(str(export_checkpoint(ref_ckpt, tmp_path / "export_b") / "model.safetensors"))
    assert set(a) == set(b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"export of the 4-rank checkpoint-2 vs the reference's: max |dweight| {diff:.2e}")
    assert diff <= TOL


@pytest.mark.slow
def test_resume_on_another_layout_matrix(data, tmp_path):
    """SP 4 -> SP 2 x dp 2 (4 ranks), ring 2 -> ulysses 2 (SGD), FSDP2 off -> on, 2 ranks -> 4, DPO SP 2 ->
    SP 1 x dp 2; each against its uninterrupted SP = 1 run."""
    c = {
        "sp4_to_sp2dp2": (4, _cfg(data, tmp_path / "a", sp=4), 4, {"sequence_parallel": {"size": 2}}),
        "ring2_to_ulysses2": (2, _cfg(data, tmp_path / "b", sp={"size": 2, "ring_degree": 2},
                                      optimizer={"name": "sgd", "lr": 0.5}),
                              2, {"sequence_parallel": {"size": 2, "ulysses_degree": 2}}),
        "fsdp_off_to_on": (2, _cfg(data, tmp_path / "c", sp=2), 2, {"fsdp": True}),
        "2_ranks_to_4": (2, _cfg(data, tmp_path / "d", sp=2), 4, {"sequence_parallel": 2, "fsdp": True}),
        "dpo_sp2_to_sp1dp2": (2, _cfg(data, tmp_path / "e", "dpo", sp=2), 2, {"sequence_parallel": 1}),
    }
    firsts = {w: [dict(cfg, max_steps=SPLIT) for a, cfg, _, _ in c.values() if a == w] for w in (2, 4)}
    seconds = {w: [dict(cfg, **b_over) for _, cfg, b, b_over in c.values() if b == w] for w in (2, 4)}
    run_distributed(_phases, 2, firsts[2], timeout=900)
    run_distributed(_phases, 4, firsts[4] + seconds[4], timeout=900)
    run_distributed(_phases, 2, seconds[2], timeout=900)
    for name, (_, cfg, _, _) in c.items():
        _compare(name, Path(cfg["output_dir"]), _reference(cfg, tmp_path / f"{name}_ref"))


@pytest.mark.slow
def test_resume_with_another_global_batch(data, tmp_path):
    """grad_accum 4 -> 2 at the resume (2 ranks, SP 2): announced (steps per epoch 2 -> 3, the row the data
    continues at), and the steps after it are those of an uninterrupted run that switches the batch at the same
    row (a reference of two SP = 1 launches)."""
    base = _cfg(data, tmp_path / "run", sp=2, global_batch_size=None, grad_accum=4)
    res = run_distributed(_phases, 2, [dict(base, max_steps=SPLIT), dict(base, grad_accum=2)], timeout=900)[0]
    said = res[1]["said"]
    assert "global batch 4 -> 2 examples per step" in said and "steps per epoch 2 -> 3" in said, said
    assert "the data continues at row 8 (epoch 1: 2 of its 6 examples done)" in said, said
    ref = dict(base, sequence_parallel=1, output_dir=str(tmp_path / "ref"))
    _phases([dict(ref, max_steps=SPLIT), dict(ref, grad_accum=2)])
    _compare("global batch 4 -> 2", tmp_path / "run", tmp_path / "ref")


def test_global_row_order_and_batch_rules():
    """The data stream: one global row order (the per-dp-slot sampler's when dp divides the rows), a position
    that means the same row at any dp; global_batch_size -> grad_accum per dp (refusals name the fix);
    num_epochs -> steps, continuing a resumed position at another global batch."""
    from seqpar.data import SequenceParallelSampler
    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict, resolve_grad_accum, steps_for_epochs
    from seqpar.train.dataset.streams import DataStream

    for n, dp in ((12, 2), (12, 3), (7, 1)):  # dp divides n: the sampler's per-slot order, epoch after epoch
        for d in range(dp):
            sampler, s = SequenceParallelSampler(n, dp, d, shuffle=True, seed=5), DataStream(n, dp, d, True, 5)
            want = []
            for epoch in range(3):
                sampler.set_epoch(epoch)
                want += list(sampler)
            assert [i for _ in range(len(want) // 2) for i in s.take(2)] == want[: len(want) // 2 * 2]
    # Any dp reads the same global rows: 3 steps of 4 rows at dp 1, then at dp 2 from that position.
    one = DataStream(7, 1, 0, True, 5)
    rows = [one.take(4) for _ in range(5)]
    two = [DataStream(7, 2, d, True, 5) for d in range(2)]
    for s in two:
        s.load_state_dict({"rows": 12})
    for k in range(3, 5):
        got = [two[0].take(2), two[1].take(2)]
        assert sorted(got[0] + got[1]) == sorted(rows[k]) and [got[0][0], got[1][0], got[0][1], got[1][1]] == rows[k]
    assert two[0].rows == two[1].rows == 20 and two[0].state_dict() == {"rows": 20, "epoch": 2}
    base = {"model": "tiny:llama", "dataset": {"path": "x.jsonl", "max_length": 64}, "micro_batch_size": 2,
            "global_batch_size": 8}
    cfg = config_from_dict(base)
    assert [resolve_grad_accum(cfg, dp).grad_accum for dp in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(SeqParError, match="global_batch_size=8 is not a multiple of dp .3. x micro_batch_size .2. = 6"):
        resolve_grad_accum(cfg, 3)
    ep = config_from_dict({**base, "num_epochs": 2, "global_batch_size": None, "grad_accum": 2})  # 4 rows per step
    assert steps_for_epochs(ep, 10, 1) == 5  # 20 rows
    assert steps_for_epochs(ep, 10, 2) == 3  # 8 rows per step
    assert steps_for_epochs(ep, 10, 2, start=(2, 8)) == 4  # 12 rows left at 8 per step: 2 more
