"""Atomic writes: a file is written beside its destination under a hidden temporary name and renamed
over it only once whole, so a reader (or a crash) sees the old file or the new one, never half of one.

A temporary name carries its writer: `.NAME.<pid>@<host>.<random><suffix>`. A writer that was killed
(SIGKILL, power loss) cannot remove its file, so the next writer of the same destination removes the
temporary files whose writer is a dead process of this host (`sweep_stale`); a live writer's, or another
host's, are left alone. Only a regular file (or nothing) is replaced: a device, FIFO, socket or directory
at the destination is refused, and a symbolic link is written through (the file it names is replaced).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from jitllm.core.errors import JitllmError
from jitllm.core.paths import special_kind

def temp_prefix(name: str) -> str:
    """The prefix of this process's temporary names for `name`, `.NAME.<pid>@<host>.` (mkstemp and mkdtemp
    add the random part; `sweep_stale` reads the writer back)."""
    return f".{name}.{os.getpid()}@{socket.gethostname()}."


def writable_target(dest: str | os.PathLike) -> Path:
    """The path an atomic write of `dest` replaces: `dest`, or the file a symbolic link at `dest` names.
    Raises JitllmError where that is something other than a regular file or nothing (a device node
    replaced by a regular file is data loss, and a FIFO would block)."""
    dest = Path(dest)
    target = Path(os.path.realpath(dest)) if dest.is_symlink() else dest
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as e:
        raise JitllmError(f"cannot write {dest}: {e.strerror or e}") from None
    what = special_kind(mode)
    if what is not None:
        via = f" (via the link {dest})" if target != dest else ""
        raise JitllmError(f"cannot write {target}{via}: it is {what}, not a regular file")
    return target


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def sweep_stale(directory: Path, name: str) -> list[Path]:
    """Remove the temporary files and directories for `name` in `directory` whose writer was a process of
    this host that no longer exists; returns what it removed."""
    # mkstemp and mkdtemp add 8 characters of [a-z0-9_] to the prefix, then the suffix
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)@{re.escape(socket.gethostname())}\.[a-z0-9_]{{8}}.*")
    swept = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return swept
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            swept.append(Path(entry.path))
    return swept


def umask_mode(mode: int) -> int:
    """`mode` as a newly created file or directory would get it (the process's umask applied)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """A fresh temporary path beside `dest` for the body to write (by name: a library's own writer);
    renamed over `dest` when the body returns, removed when it raises (SIGTERM too, where the CLI's
    handler is installed: jitllm.core.termination). The file gets the permissions a new file would (the
    umask's), not mkstemp's 0600. JitllmError where `dest` is not a regular file; OSError reaches the
    caller, which names what could not be written in its own words."""
    target = writable_target(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(target.parent, target.name)
    fd, name = tempfile.mkstemp(prefix=temp_prefix(target.name), suffix=suffix, dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, umask_mode(0o666))
        writable_target(target)  # (again: something may have appeared there while the body ran)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_write(dest: str | os.PathLike, suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """`atomic_path` with the temporary file opened for binary writing."""
    with atomic_path(dest, suffix) as tmp, open(tmp, "wb") as f:
        yield f
