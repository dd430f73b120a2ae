"""Compiling in a forked child process, so that SIGTERM and Ctrl-C end a command promptly.

A TVM compile is one C++ call of 15-40 s; Python runs a signal handler only when that call returns, so a
SIGTERM (jitllm.core.termination) or a Ctrl-C sent mid-compile waited for the compile. Here the parent
only waits on a pipe, which a signal interrupts at once: the handler's exception unwinds the parent, and
on its way out the child's process group (the child and the compiler it runs for the link) is killed and
reaped, so nothing of the compile is left running and the artifact's temporary directory is removed by
the caller's cleanup. The child is a fork (TVM is already imported: a fresh interpreter would spend
seconds importing it) in a process group of its own (out of the terminal's reach: the parent decides
what Ctrl-C does), ignores SIGINT, is killed by the kernel if the parent dies without cleanup (SIGKILL),
and ends with os._exit (the parent's atexit handlers and buffered output stay the parent's).
The objects the child inherits are frozen out of its garbage collector (gc.freeze before the fork): a
cycle the parent had not collected yet, holding a library object whose destructor joins threads that only
exist in the parent (an ONNX Runtime session's pool), hung the child in that destructor for good.

Where fork cannot be relied on (not Linux: macOS frameworks are not fork-safe), the work runs in this
process and a signal is handled when it returns.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
from collections.abc import Callable

from jitllm.core.errors import JitllmError

FORKS = sys.platform == "linux"
"""Whether work runs in a forked child (Linux) or in this process."""
_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # (linux/prctl.h)
_IN_CHILD = False
"""Whether this process is such a child (where run_in_child runs its work in place)."""
_MESSAGE_BYTES = 8192
"""At most this much of a child's error comes back (well within a pipe's buffer: a polled child that
has not been read from never blocks on its write)."""


def run_in_child(work: Callable[[], None]) -> None:
    """Run `work` in a forked child and wait for it. A JitllmError in the child is raised here with its
    message; any other failure, or the child dying, is a JitllmError naming it. Inside a child already
    (a background compile, start_child), `work` runs there: that child is the compile process."""
    if not FORKS or _IN_CHILD:
        work()
        return
    child = start_child(work)
    try:
        child.wait()
    except BaseException:  # SIGTERM's Terminated, Ctrl-C's KeyboardInterrupt: stop the compile with us
        child.kill()
        raise


class Child:
    """A forked child running `work` (start_child): wait for it, poll it between other work, or kill it."""

    def __init__(self, pid: int, read: int) -> None:
        self.pid, self._read = pid, read
        self.error: JitllmError | None = None
        """Why it failed, once it has ended (None: it succeeded, or has not ended)."""
        self.done = False

    def poll(self) -> bool:
        """Whether it has ended (then `error` says how), without waiting."""
        if not self.done:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._ended(status)
        return self.done

    def wait(self) -> None:
        """Wait for it to end; its failure raised as a JitllmError."""
        if not self.done:
            message = _read_all(self._read)  # (until the child exits; a signal's exception interrupts it)
            _, status = os.waitpid(self.pid, 0)
            self._ended(status, message)
        if self.error is not None:
            raise self.error

    def kill(self) -> None:
        """Kill it and its process group (the compiler it runs for the link) and reap it."""
        if not self.done:
            _kill(self.pid)
            self.done = True
            self.error = JitllmError("the compile process was stopped")
            os.close(self._read)

    def _ended(self, status: int, message: bytes | None = None) -> None:
        if message is None:
            message = _read_all(self._read)  # (the child has exited: what it wrote is all there)
        os.close(self._read)
        self.done = True
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            self.error = JitllmError(f"the compile process was killed by signal {signal.Signals(-code).name}")
        elif code > 0:
            self.error = JitllmError(message.decode(errors="replace") or f"the compile process failed (exit status {code})")


def start_child(work: Callable[[], None]) -> Child:
    """Fork a child running `work` (the module docstring) and return at once; the caller waits, polls or
    kills it (Linux only: FORKS)."""
    read, write = os.pipe()
    # SIGTERM and SIGINT are held back over the fork, so that one arriving then is raised inside the `try`
    # that kills the child (not between fork and try, which left the child compiling, an orphan).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    parent = os.getpid()
    gc.freeze()  # (the child never collects what it inherits; the parent unfreezes below)
    try:
        pid = os.fork()
    except BaseException:
        gc.unfreeze()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        os.close(read)
        os.close(write)
        raise
    if pid == 0:  # the child
        os.close(read)
        _child(work, write, previous, parent)
    gc.unfreeze()
    child = Child(pid, read)
    try:
        os.close(write)
        try:
            os.setpgid(pid, pid)  # (also here: the group exists before the parent may have to kill it)
        except OSError:  # (the child did it first)
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # (a signal held back is raised here)
    except BaseException:
        child.kill()
        raise
    return child


def _child(work: Callable[[], None], write: int, mask: set[signal.Signals], parent: int) -> None:
    global _IN_CHILD
    code, message = 0, ""
    _IN_CHILD = True
    try:
        os.setpgid(0, 0)  # (its own group: the parent kills the compiler's link step with it)
        _die_with_parent(parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        work()
    except JitllmError as e:
        code, message = 1, str(e)
    except BaseException as e:  # noqa: BLE001 (reported to the parent as one line)
        code, message = 2, f"the compile failed: {type(e).__name__}: {e}"
    try:
        os.write(write, message.encode()[:_MESSAGE_BYTES])
    finally:
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this child when its parent dies (SIGKILL included, which runs no cleanup of
    the parent's): an orphaned compile would go on for tens of seconds, into a directory the next writer
    sweeps as a dead process's."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != parent:
        os._exit(3)  # (the parent is already gone, or the kernel refused: do not compile unwatched)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
