"""A conversion cache on disk: convert once (e.g. GGUF -> safetensors), load the result afterwards.

    path = converted_dir("smollm2-<size>-<mtime>", write)   # write(tmp_dir) saves the converted files

Root: $SEQPAR_CACHE, else ~/.cache/seqpar. Safe when several ranks start at once: the first process
to take the lock (fcntl, where available) converts into a temporary directory next to the target
and renames it into place (atomic); the others wait on the lock and then find the target. Without
fcntl, every process may convert and the first rename wins (the others discard theirs). A target
directory that exists is therefore always complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import SeqParError

__all__ = ["CACHE_ENV", "cache_root", "converted_dir"]

CACHE_ENV = "SEQPAR_CACHE"


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "seqpar"


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: first rename wins instead
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def converted_dir(key: str, write: Callable[[Path], None]) -> Path:
    """The cache directory for `key`, created by `write(tmp_dir)` if it does not exist yet."""
    root = cache_root()
    target = root / key
    if target.is_dir():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{key}.lock").touch()
    except OSError as e:
        raise SeqParError(f"cannot write the seqpar cache at {root} ({e.strerror}): set ${CACHE_ENV} to a "
                          f"writable directory") from None
    with _lock(root / f"{key}.lock"):
        if target.is_dir():  # another process converted while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root))
        try:
            write(tmp)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the cache is for every user of the root
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            # Lost the race (no fcntl): keep the winner's copy.
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
