"""Atomic writes: a file is written beside its destination under a hidden temporary name and renamed
over it only once whole, so a reader (or a crash) sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """A fresh temporary path beside `dest` for the body to write (by name: a library's own writer);
    renamed over `dest` when the body returns, removed when it raises. The file gets the permissions
    a new file would (the umask's), not mkstemp's 0600. OSError reaches the caller, which names what
    could not be written in its own words."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix, dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_write(dest: str | os.PathLike, suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """`atomic_path` with the temporary file opened for binary writing."""
    with atomic_path(dest, suffix) as tmp, open(tmp, "wb") as f:
        yield f
