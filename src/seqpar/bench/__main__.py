"""CLI: python -m seqpar.bench attention [--out bench_results/attention.json] [--png FILE] [--quick]."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpar.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    att = sub.add_parser("attention", help="comm bytes vs theory, causal load balance, SP vs one-process time")
    att.add_argument("--out", default="bench_results/attention.json", help="JSON output path")
    att.add_argument("--png", default=None, help="PNG output path (default: next to --out); 'none' to skip")
    att.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, seconds)")
    att.add_argument(
        "--peers",
        choices=("auto", "deepspeed", "none"),
        default="auto",
        help="DeepSpeed Ulysses side by side: auto = when installed (not a seqpar dependency)",
    )
    att.add_argument("--timeout", type=float, default=540.0, help="per spawned world, seconds")
    args = parser.parse_args(argv)

    from .attention import run

    result = run(quick=args.quick, timeout=args.timeout, peers=args.peers)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    if png.lower() != "none":
        from .plot import plot_attention

        plot_attention(result, png)
        print(f"wrote {png}")
    from .plot import summary_lines

    print("\n".join(summary_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
