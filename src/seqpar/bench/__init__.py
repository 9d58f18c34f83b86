"""Benchmarks that write JSON (and a PNG): `python -m seqpar.bench attention|memory --out FILE [--quick]`."""
