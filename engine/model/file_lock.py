"""`file_lock`: an exclusive inter-process lock around work that several processes may start at
once (a GGUF conversion in loader.py, the ggml kernels' build in ggml_kernels.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (POSIX); without fcntl the atomic rename alone guards readers."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
