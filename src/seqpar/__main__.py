"""`python -m seqpar ...` (what torchrun launches: `torchrun --nproc-per-node 4 -m seqpar train cfg.yaml`)."""

from .cli.main import main

raise SystemExit(main())
