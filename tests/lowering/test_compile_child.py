"""run_in_child: work in a forked child; the parent's signals end it at once; its errors come back as one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitllm.core.errors import JitllmError
from jitllm.lowering.compile_child import FORKS, run_in_child

pytestmark = pytest.mark.skipif(not FORKS, reason="work runs in-process where fork is not used")
ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import hashlib, sys
from pathlib import Path
from jitllm.core.termination import install_termination_handler
from jitllm.lowering.compile_child import run_in_child

def long_c_call():  # (one C call of a minute or more: in-process, no signal handler would run before its end)
    hashlib.pbkdf2_hmac("sha256", b"k", b"s", 200_000_000)
    Path(sys.argv[1]).write_text("finished")

install_termination_handler("t")
try:
    run_in_child(long_c_call)
finally:
    Path(sys.argv[2]).write_text("unwound")  # (the parent's cleanup ran)
"""


def test_sigterm_ends_the_work_before_it_finishes_and_leaves_no_process(tmp_path):
    finished, unwound = tmp_path / "finished", tmp_path / "unwound"
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(finished), str(unwound)], stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    deadline = time.monotonic() + 60
    while not (os.path.exists(children) and open(children).read().split()):
        assert time.monotonic() < deadline and proc.poll() is None, "the child never started"
        time.sleep(0.02)
    child = int(open(children).read().split()[0])
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and stderr == "t: error: terminated\n", (proc.returncode, stderr)
    assert unwound.exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(child, 0)  # (the child, killed with its group, cannot finish later)
    assert not finished.exists()


def _fails() -> None:
    raise JitllmError("no compiler here")


def _crashes() -> None:
    raise ValueError("bad IR")


def _dies() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("work, message", [(_fails, "no compiler here"),
                                           (_crashes, "the compile failed: ValueError: bad IR"),
                                           (_dies, "the compile process was killed by signal SIGKILL")])
def test_failures_in_the_child_are_one_jitllm_error(work, message):
    with pytest.raises(JitllmError, match=message):
        run_in_child(work)


def test_work_done_in_the_child_is_seen_by_the_parent(tmp_path):
    out = tmp_path / "out"
    run_in_child(lambda: out.write_text("made"))
    assert out.read_text() == "made"


def test_a_child_whose_parent_is_killed_dies_with_it(tmp_path):
    """SIGKILL runs no cleanup in the parent; the kernel ends the child (PR_SET_PDEATHSIG), so no orphan
    compile goes on into a directory the next writer sweeps."""
    finished, unwound = tmp_path / "finished", tmp_path / "unwound"
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(finished), str(unwound)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    deadline = time.monotonic() + 60
    while not (os.path.exists(children) and open(children).read().split()):
        assert time.monotonic() < deadline and proc.poll() is None, "the child never started"
        time.sleep(0.02)
    child = int(open(children).read().split()[0])
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(child, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
    assert not finished.exists() and not unwound.exists()


class _Finalized:
    """In a reference cycle (so only the garbage collector frees it); says in which process it was freed."""

    def __init__(self, record: Path) -> None:
        self.record, self.cycle = record, self

    def __del__(self) -> None:
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_the_child_never_collects_garbage_it_inherited(tmp_path):
    """A cycle the parent had not collected yet, holding an object whose destructor waits on the parent's
    threads (an ONNX Runtime session), hung a compile child for good in that destructor; the child must
    leave what it inherits alone, and the parent still collects it."""
    import gc

    record = tmp_path / "freed"
    gc.disable()  # (the cycle must still be uncollected at the fork)
    try:
        _Finalized(record)
        run_in_child(gc.collect)
    finally:
        gc.enable()
    assert not record.exists(), "the child ran the destructor of an object it inherited"
    gc.collect()
    assert record.read_text() == f"{os.getpid()}\n"
