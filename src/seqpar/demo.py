"""`python -m seqpar.demo` (`make demo`): long-context retrieval fine-tuning of the real
SmolLM2-135M-Instruct with SP=4 on 4 gloo ranks, checked against an SP=1 run.

The task, built offline from real text: a long document made of Python standard-library source
files (this interpreter's own stdlib) with one line `ACCESS_KEY = "<word>-<number>"` buried at a
random depth, followed by the question "What is the value of ACCESS_KEY?". Only the answer tokens
are supervised, so the gradient must flow through attention across the whole document -- across
every SP shard. The demo then runs `seqpar verify` logic: the same steps with SP=1 in one process,
and writes the overlaid loss curves (PNG) and max |dloss| (JSON).

Options: --steps (default 3), --max-length (tokens per example, default 1024), --nproc (default 4),
--out (default demo_output/). Times measured on 2 shared CPU cores: README.md, "Quickstart".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

KEY_WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "indigo", "jasper",
             "kelp", "lagoon", "meadow", "nebula", "onyx", "prairie", "quartz", "reef", "sierra", "tundra"]
QUESTION = (
    "Somewhere in the code above a line assigns ACCESS_KEY. What is the value of ACCESS_KEY? "
    "Answer with the value only."
)


def _stdlib_files(rng: random.Random) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    if not files:
        raise SystemExit(f"no Python sources found under {root}")
    rng.shuffle(files)
    return files


def build_examples(tok, n: int, max_length: int, seed: int = 0) -> list[dict[str, str]]:
    """n retrieval rows {"instruction", "response"} whose chat-rendered length is just under max_length."""
    rng = random.Random(seed)
    files = _stdlib_files(rng)
    overhead = len(tok.chat([{"role": "user", "content": "\n\n" + QUESTION}], add_generation_prompt=True)) + 16
    budget = max_length - overhead
    rows = []
    for i in range(n):
        key = f"{rng.choice(KEY_WORDS)}-{rng.randint(1000, 9999)}"
        lines: list[str] = []
        n_tok = 0
        for f in files[i * 3:] + files[: i * 3]:
            for line in [f"# ---- file: {f.name} ----", *f.read_text(errors="replace").splitlines()]:
                t = len(tok.encode(line + "\n"))
                if n_tok + t > budget:
                    break
                lines.append(line)
                n_tok += t
            if n_tok + 40 > budget:
                break
        # Bury the key at a random depth (never in the last 10% right before the question).
        pos = rng.randint(int(len(lines) * 0.05), int(len(lines) * 0.9))
        key_line = f'ACCESS_KEY = "{key}"'
        lines.insert(pos, key_line)
        while len(tok.encode("\n".join(lines) + "\n\n" + QUESTION)) > budget and len(lines) > pos + 2:
            lines.pop()
        rows.append({"instruction": "\n".join(lines) + "\n\n" + QUESTION, "response": key})
    return rows


def _peak_alloc_line(verify_dir: Path, nproc: int) -> str:
    """Per-rank peak of live tensor bytes (seqpar.memory.meter; max over ranks and steps), SP vs SP=1."""
    from .train.loop.plots import read_metrics

    peaks = {}
    for run in ("sp", "ref"):
        vals = [r["peak_alloc_mb"] for r in read_metrics(verify_dir / run / "metrics.jsonl") if "peak_alloc_mb" in r]
        peaks[run] = max(vals) if vals else None
    if None in peaks.values():
        return "[demo] peak_alloc: not measured (memory.measure is false)"
    return (f"[demo] peak memory per rank (exact live tensor bytes, max over ranks and steps): SP={nproc} "
            f"{peaks['sp']:.1f} MiB vs SP=1 {peaks['ref']:.1f} MiB ({peaks['sp'] / peaks['ref']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqpar.demo", description=__doc__.split("\n\n")[0])
    # 3 steps: the step-1 gradients and two AdamW updates compared (5 took 5/3 the time for no more evidence)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--out", default="demo_output")
    p.add_argument("--tolerance", type=float, default=None, help="max |dloss| bar (default fp32 1e-5)")
    args = p.parse_args(argv)
    from .errors import SeqParError

    try:
        for flag, v in (("--steps", args.steps), ("--max-length", args.max_length), ("--nproc", args.nproc),
                        ("--rows", args.rows)):
            if v < 1:
                raise SeqParError(f"{flag} {v}: give a whole number >= 1")
        return _run(args)
    except SeqParError as e:  # bad input: one line, as the seqpar command prints it
        print(f"seqpar demo: error: {e}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace) -> int:
    from .hf import load_smollm2_tokenizer
    from .train.config import config_from_dict
    from .train.model.tokenizers import HFTokenizer
    from .train.verify import verify

    t0 = time.time()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(load_smollm2_tokenizer())
    rows = build_examples(tok, args.rows, args.max_length)
    data = out / "retrieval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lens = [len(tok.chat([{"role": "user", "content": r["instruction"]}], True)) for r in rows]
    print(f"[demo] {len(rows)} retrieval examples from stdlib sources, {min(lens)}-{max(lens)} prompt tokens "
          f"(key buried in the document; answer supervised) -> {data}", flush=True)
    cfg = config_from_dict({
        "model": "smollm2",
        "dataset": {"path": str(data), "format": "instruction", "max_length": args.max_length},
        "finetuning": {"method": "lora", "r": 16, "alpha": 32, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "sequence_parallel": {"size": args.nproc},
        "precision": "fp32",
        "micro_batch_size": 1,
        "grad_accum": 2,
        "max_steps": args.steps,
        "optimizer": {"lr": args.lr},
        "output_dir": str(out),
        "seed": 0,
    })
    print(f"[demo] SmolLM2-135M-Instruct (9 q / 3 kv heads), LoRA r=16, SP={args.nproc} on {args.nproc} gloo ranks, "
          f"{args.steps} steps x 2 micro-batches of {args.max_length} tokens; then the SP=1 reference", flush=True)
    rep = verify(cfg, args.steps, args.nproc, out / "verify", tolerance=args.tolerance)
    print(f"[demo] SP={args.nproc} loss:  " + " ".join(f"{x:.5f}" for x in rep["sp_loss"]))
    print("[demo] SP=1 loss:  " + " ".join(f"{x:.5f}" for x in rep["ref_loss"]))
    print(f"[demo] max |dloss| = {rep['max_abs_dloss']:.2e} (tolerance {rep['tolerance']:.0e}): "
          f"{'PASS' if rep['passed'] else 'FAIL'}")
    print(_peak_alloc_line(out / "verify", args.nproc))
    print(f"[demo] loss curves: {rep['png']}")
    print(f"[demo] report:      {rep['json']}")
    print(f"[demo] done in {time.time() - t0:.0f}s")
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
