"""Benchmarks that write JSON (and a PNG): `python -m seqpar.bench attention --out FILE [--png FILE] [--quick]`."""
