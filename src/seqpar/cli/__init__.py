"""Command line: `seqpar train|verify|check CONFIG` (see docs/training.md)."""

from .main import main

__all__ = ["main"]
