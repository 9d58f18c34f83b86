"""compute_metrics / preprocess_logits_for_metrics / predict() of the HF Trainer drop-in under SP, against the stock
`transformers.Trainer` on one process (same tiny Llama, same ragged rows).

The script runs (a) the stock Trainer in one process (eval batch 2 with an attention-mask padding collator, and
eval batch 1, whose arrays have no in-batch padding), and (b) `SequenceParallelTrainer` under torchrun (eval batch
2). compute_metrics gets token accuracy from argmax predictions and the mean max log-prob from a tuple returned by
preprocess_logits_for_metrics. Checked: the metrics equal (accuracy exactly, floats within 1e-5), eval_loss is the
global token-mean CE (an independent one-process sum, 1e-5), predict()'s label_ids equal the stock ones exactly,
its predictions equal the stock batch-1 arrays (argmax exactly, log-probs 1e-5) and the stock batch-2 arrays on
every row's own positions (past a row's end seqpar holds -100, the stock Trainer its outputs on pad tokens), and
predict() without preprocess_logits_for_metrics returns the full logits [rows, S, vocab] within 1e-5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import run_script

SCRIPT = r'''
import json, sys
import numpy as np
import torch, datasets
from transformers import Trainer, TrainingArguments
from seqpar.hf import tiny_model

mode, out = sys.argv[1], sys.argv[2]
sp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
g = torch.Generator().manual_seed(0)
rows = []
for i in range(int(extra.get("rows", 7))):
    n = int(torch.randint(9, 41, (1,), generator=g))
    ids = torch.randint(3, 64, (n,), generator=g).tolist()
    k = int(torch.randint(0, 6, (1,), generator=g))
    # row 0: supervised from its first token; row 1: no labels (all supervised); others: a masked prompt of k
    lab = ids if i == 0 else None if i == 1 else [-100] * k + ids[k:]
    rows.append({"input_ids": ids, "labels": lab})
ds = datasets.Dataset.from_list(rows)

def pad_collate(batch):
    m = max(len(r["input_ids"]) for r in batch)
    pad = lambda x, v: x + [v] * (m - len(x))
    return {"input_ids": torch.tensor([pad(r["input_ids"], 0) for r in batch]),
            "labels": torch.tensor([pad(r["labels"] if r["labels"] is not None else r["input_ids"], -100)
                                    for r in batch]),
            "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in batch])}

def preprocess(logits, labels):  # per position: argmax and its log-prob
    return logits.argmax(-1), torch.log_softmax(logits.float(), -1).max(-1).values

def compute_metrics(p, compute_result=True):
    ids, lp = p.predictions
    pred, lab = ids[:, :-1], p.label_ids[:, 1:]
    m = lab != -100
    return {"accuracy": float((pred[m] == lab[m]).mean()), "mean_max_logp": float(lp[:, :-1][m].mean()),
            "n_targets": int(m.sum())}

class Accumulated:  # batch_eval_metrics: called per eval step with tensors, returns at compute_result=True
    def __init__(self):
        self.hit, self.n, self.lp = 0, 0, 0.0

    def __call__(self, p, compute_result=False):
        ids, lp = (np.asarray(x) for x in p.predictions)
        lab = np.asarray(p.label_ids)[:, 1:]
        m = lab != -100
        self.hit += int((ids[:, :-1][m] == lab[m]).sum())
        self.n += int(m.sum())
        self.lp += float(lp[:, :-1][m].astype(np.float64).sum())
        if not compute_result:
            return {}
        out = {"accuracy": self.hit / self.n, "mean_max_logp": self.lp / self.n, "n_targets": self.n}
        self.__init__()
        return out

def args(bs, **kw):
    return TrainingArguments(output_dir=f"{out}/t{bs}", per_device_eval_batch_size=bs, report_to=[], use_cpu=True,
                             disable_tqdm=True, **kw)

def save(name, p):
    ids, lp = p.predictions
    np.savez(f"{out}/{name}.npz", ids=ids, lp=lp, labels=p.label_ids)

res = {}
model = tiny_model("llama", 3, 1, vocab_size=64, seed=0)
if mode == "plain":
    for bs in (2, 1):
        t = Trainer(model=model, args=args(bs), data_collator=pad_collate, compute_metrics=compute_metrics,
                    preprocess_logits_for_metrics=preprocess)
        res[f"eval{bs}"] = t.evaluate(ds)
        p = t.predict(ds)
        save(f"pred{bs}", p)
        res[f"test{bs}"] = p.metrics
    t.preprocess_logits_for_metrics = None
    t.compute_metrics = None
    np.save(f"{out}/logits1.npy", t.predict(ds).predictions)
    tot, cnt = 0.0, 0  # independent reference for eval_loss: the global token-mean CE
    with torch.no_grad():
        for r in rows:
            lab = torch.tensor((r["labels"] or r["input_ids"])[1:])
            logits = model(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1]
            tot += float(torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum"))
            cnt += int((lab != -100).sum())
    res["ref_loss"], res["ref_items"] = tot / cnt, cnt
else:
    from seqpar.hf.trainer import SequenceParallelTrainer
    batch_metrics = bool(extra.get("batch_eval_metrics"))
    t = SequenceParallelTrainer(model=model, args=args(2, batch_eval_metrics=batch_metrics), eval_dataset=ds,
                                compute_metrics=Accumulated() if batch_metrics else compute_metrics,
                                preprocess_logits_for_metrics=preprocess,                      # <- as stock
                                sequence_parallel_size=sp, packing=bool(extra.get("packing")))
    res["mesh"] = [t.sp_mesh.dp_size, t.sp_mesh.sp_size, t.sp_mesh.ring_degree, t.sp_mesh.ulysses_degree]
    res["eval2"] = t.evaluate()
    p = t.predict(ds)
    res["test2"] = p.metrics
    if t.is_world_process_zero():
        save("pred2", p)
    t.preprocess_logits_for_metrics = None
    t.compute_metrics = None
    logits = t.predict(ds).predictions
    if t.is_world_process_zero():
        np.save(f"{out}/logits2.npy", logits)
    if not t.is_world_process_zero():
        sys.exit(0)
json.dump(res, open(f"{out}/result.json", "w"))
'''


def _run_both(tmp_path: Path, nproc: int, sp: int, extra: dict | None = None) -> tuple[dict, dict]:
    script = tmp_path / "metrics.py"
    script.write_text(SCRIPT)
    plain, spd = tmp_path / "plain", tmp_path / "sp"
    plain.mkdir()
    spd.mkdir()
    tail = [json.dumps(extra or {})]
    run_script([sys.executable, str(script), "plain", str(plain), "1", *tail], tmp_path, plain / "result.json",
               timeout=300)
    run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                str(script), "sp", str(spd), str(sp), *tail], tmp_path, spd / "result.json", timeout=300)
    return (json.loads((plain / "result.json").read_text()), json.loads((spd / "result.json").read_text()))


def _check(tmp_path: Path, ref: dict, got: dict, prefixes: tuple[str, ...] = ("eval", "test")) -> None:
    plain, spd = tmp_path / "plain", tmp_path / "sp"
    for prefix in prefixes:
        want, have = ref[f"{prefix}2"], got[f"{prefix}2"]
        assert have[f"{prefix}_accuracy"] == want[f"{prefix}_accuracy"], (have, want)
        assert have[f"{prefix}_n_targets"] == want[f"{prefix}_n_targets"] == ref["ref_items"], (have, want)
        assert abs(have[f"{prefix}_mean_max_logp"] - want[f"{prefix}_mean_max_logp"]) <= 1e-5, (have, want)
        assert abs(have[f"{prefix}_loss"] - ref["ref_loss"]) <= 1e-5, (have, ref["ref_loss"])
        assert have[f"{prefix}_items"] == ref["ref_items"]
        assert f"{prefix}_runtime" in have and f"{prefix}_perplexity" in have
    p2, s1, s2 = (np.load(d / f"{n}.npz") for d, n in ((plain, "pred2"), (plain, "pred1"), (spd, "pred2")))
    # label_ids: the stock Trainer's, exactly (unshifted, -100 past each row's end and where unsupervised)
    assert s2["labels"].shape == p2["labels"].shape and (s2["labels"] == p2["labels"]).all()
    # predictions: the stock batch-1 arrays (no in-batch padding) exactly / within 1e-5
    assert s2["ids"].shape == s1["ids"].shape and (s2["ids"] == s1["ids"]).all()
    assert s2["lp"].shape == s1["lp"].shape and np.abs(s2["lp"] - s1["lp"]).max() <= 1e-5
    # and the stock batch-2 arrays on every row's own positions (in-batch padding: seqpar -100, stock pad outputs)
    own = s1["ids"] != -100
    assert (s2["ids"][own] == p2["ids"][own]).all() and (s2["ids"][~own] == -100).all()
    assert np.abs(s2["lp"][own] - p2["lp"][own]).max() <= 1e-5
    # no preprocess_logits_for_metrics: the full logits in sequence order
    lg1, lg2 = np.load(plain / "logits1.npy"), np.load(spd / "logits2.npy")
    assert lg1.shape == lg2.shape == (*s1["ids"].shape, 64) and np.abs(lg2 - lg1).max() <= 1e-5
    print(f"metrics SP vs stock: acc {got[f'{prefixes[0]}2'][f'{prefixes[0]}_accuracy']:.4f}, "
          f"max |dlogit| {np.abs(lg2 - lg1).max():.1e}")


def test_hf_trainer_compute_metrics_and_predict_match_stock_trainer(tmp_path):
    """dp 1 x SP 2 (zigzag ring of 2), 7 ragged rows (9-40 tokens), eval batch 2."""
    ref, got = _run_both(tmp_path, 2, 2)
    assert got["mesh"] == [1, 2, 2, 1]
    _check(tmp_path, ref, got)


@pytest.mark.slow
def test_hf_trainer_compute_metrics_dp2_x_sp2_packed_batch_metrics(tmp_path):
    """dp 2 x SP 2 (4 ranks), 5 rows (rows of the two dp ranks gathered back into dataset order, one dp rank
    running a padding batch), a packing collator (metrics collate one row per sequence) and batch_eval_metrics
    (the metric, called per eval step with tensors, accumulates counts and returns them at compute_result)."""
    ref, got = _run_both(tmp_path, 4, 2, {"packing": True, "batch_eval_metrics": True, "rows": 5})
    assert got["mesh"] == [2, 2, 2, 1]
    _check(tmp_path, ref, got)


@pytest.mark.slow
def test_hf_trainer_compute_metrics_sp3(tmp_path):
    """SP 3 (3 ranks, a ring of 3: sequences padded to a multiple of 6), 9 rows."""
    ref, got = _run_both(tmp_path, 3, 3, {"rows": 9})
    assert got["mesh"][:2] == [1, 3]
    _check(tmp_path, ref, got)


TRL_SCRIPT = r'''
import json, sys
import numpy as np
import torch, datasets, trl
from seqpar.hf import load_smollm2_tokenizer, tiny_model

mode, out = sys.argv[1], sys.argv[2]
tok = load_smollm2_tokenizer()
g = torch.Generator().manual_seed(0)
words = "the cat sat on a mat while dogs ran far and birds sang".split()
def text(lo, hi):
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
ds = datasets.Dataset.from_list([{"prompt": text(3, 12), "completion": " " + text(2, 15)} for _ in range(5)])

def preprocess(logits, labels):
    return logits.argmax(-1)

def compute_metrics(p):
    pred, lab = p.predictions[:, :-1], p.label_ids[:, 1:]
    m = lab != -100
    return {"accuracy": float((pred[m] == lab[m]).mean()), "n_targets": int(m.sum())}

if mode == "stock":
    Cls, kw = trl.SFTTrainer, {}
else:
    from seqpar.trl import SequenceParallelSFTTrainer as Cls
    kw = {"sequence_parallel_size": 2}
args = trl.SFTConfig(output_dir=f"{out}/t", per_device_eval_batch_size=1 if mode == "stock" else 2, report_to=[],
                     use_cpu=True, bf16=False, disable_tqdm=True)
t = Cls(model=tiny_model("llama", 4, 2, vocab_size=len(tok), seed=0), args=args, train_dataset=ds, eval_dataset=ds,
        processing_class=tok, compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess, **kw)
res = {"eval": t.evaluate()}
p = t.predict(t.eval_dataset)  # TRL's tokenised rows (the stock predict() does not prepare a dataset)
res["test"] = p.metrics
if t.is_world_process_zero():
    np.savez(f"{out}/pred.npz", preds=p.predictions, labels=p.label_ids)
    json.dump(res, open(f"{out}/result.json", "w"))
'''


@pytest.mark.slow
def test_trl_sft_trainer_compute_metrics_matches_stock_trl(tmp_path):
    """The TRL SFT drop-in (it inherits the HF drop-in's evaluation) at SP 2 against stock trl.SFTTrainer on one
    process (eval batch 1): prompt/completion rows (completion-only labels), argmax predictions and label_ids
    equal exactly, token accuracy and target count equal."""
    script = tmp_path / "trl_metrics.py"
    script.write_text(TRL_SCRIPT)
    stock, spd = tmp_path / "stock", tmp_path / "sp"
    stock.mkdir()
    spd.mkdir()
    run_script([sys.executable, str(script), "stock", str(stock)], tmp_path, stock / "result.json", timeout=300)
    run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                "sp", str(spd)], tmp_path, spd / "result.json", timeout=300)
    ref, got = (json.loads((d / "result.json").read_text()) for d in (stock, spd))
    a, b = np.load(stock / "pred.npz"), np.load(spd / "pred.npz")
    assert a["labels"].shape == b["labels"].shape and (a["labels"] == b["labels"]).all()
    assert a["preds"].shape == b["preds"].shape and (a["preds"] == b["preds"]).all()
    assert (a["labels"][:, 0] == -100).all() and (a["labels"] != -100).sum() > 20  # completion-only labels
    for prefix in ("eval", "test"):
        for key in ("accuracy", "n_targets"):
            assert got[prefix][f"{prefix}_{key}"] == ref[prefix][f"{prefix}_{key}"], (got, ref)
