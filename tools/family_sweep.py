"""The family sweep (seqpar.hf.family_sweep) from the command line, with `seqpar train`'s pre-launch model checks.

    python tools/family_sweep.py                         # every family: the table on stdout
    python tools/family_sweep.py llama mistral           # some model types, every detail
    python tools/family_sweep.py --write-docs docs/hf.md # regenerate the marked support table
    python tools/family_sweep.py --check docs/hf.md      # exit 1 if the committed table differs

Exit status 1 when any family FAILs (silently wrong, a crash, a refusal only inside the forward).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def prelaunch(config: Any) -> None:
    """What `seqpar train` refuses before any rank starts (seqpar.train.model.checks), from the config alone."""
    from seqpar.train.model.checks import refuse_non_causal

    refuse_non_causal(config, f"tiny {config.model_type}")


def main(argv: list[str] | None = None) -> int:
    import transformers

    from seqpar.hf.family_sweep import sweep
    from seqpar.hf.family_table import read_docs, render, write_docs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_types", nargs="*", help="model types to sweep (default: every family)")
    ap.add_argument("--write-docs", metavar="MD", help="rewrite the marked family-sweep section of this file")
    ap.add_argument("--check", metavar="MD", help="compare the marked section of this file with the sweep")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    results = sweep(args.model_types or None, prelaunch=prelaunch)
    section = render(results, transformers.__version__)
    for r in results:
        worst = max(r.errors.values(), default=0.0)
        print(f"{r.status:14s} {r.model_type:26s} {worst:10.3g}  {r.detail}")
    print(f"{len(results)} families in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.write_docs:
        changed = write_docs(args.write_docs, section)
        print(f"{args.write_docs}: {'updated' if changed else 'unchanged'}", file=sys.stderr)
    if args.check:
        want = {(r.model_type, r.status) for r in results}
        got = {(row[0], row[2]) for row in read_docs(args.check)}
        if want != got:
            print(f"{args.check} differs from the sweep: {sorted(want ^ got)}", file=sys.stderr)
            return 1
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
