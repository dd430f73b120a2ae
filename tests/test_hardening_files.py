"""Issue 27's file classes at the CLI: the output path (nothing but a regular file is replaced, never the
source), interruptions (SIGTERM cleans up like Ctrl-C, stale temporary files of dead writers are swept),
and convert's memory, bounded by the largest region rather than the model."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from test_tokenizer import tiny_tokenizer_metadata

from jitllm.core.jlm import JlmFile

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TVM_NUM_THREADS": "1"}


def jitllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitllm", *args], capture_output=True, text=True, env=ENV,
                          timeout=120, check=False)


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("jitllm: error: ") and all(w in done.stderr for w in words), done.stderr


def hidden_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def synthetic_merges(tokens: list[str], count: int, rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """`count` byte-level BPE merges over `tokens`' single characters and the tokens they make, as a real
    vocabulary of that size has: half join two characters, half two of those pairs."""
    chars, known = [t for t in tokens if len(t) == 1], set(tokens)
    pairs = [p for i, j in zip(*divmod(rng.choice(len(chars) ** 2, count, replace=False), len(chars)))
             if (p := chars[i] + chars[j]) not in known][:count // 2]
    merges = [f"{p[0]} {p[1]}" for p in pairs]
    quads: dict[str, str] = {}
    while len(quads) < count - len(pairs):
        i, j = rng.integers(len(pairs), size=2)
        quads.setdefault(pairs[i] + pairs[j], f"{pairs[i]} {pairs[j]}")
    return pairs + list(quads), merges + list(quads.values())


def write_q8_gguf(path: Path, blocks: int, hidden: int = 64, ffn: int = 128, vocab: int = 264, heads: int = 4,
                  kv_heads: int = 2, merges: int = 0) -> Path:
    """A llama GGUF whose every matrix is Q8_0 GGML blocks of random bytes (nothing to quantize: a few
    hundred MB are written in seconds) and whose norms are f32; the tokenizer is the tiny byte-level one
    with `merges` more merges (synthetic_merges), padded to `vocab`."""
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(blocks)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    meta = tiny_tokenizer_metadata()
    merged, more_merges = synthetic_merges(meta["tokenizer.ggml.tokens"], merges, rng)
    tokens = meta["tokenizer.ggml.tokens"] + merged
    tokens += [f"[EXTRA{i}]" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(meta["tokenizer.ggml.token_type"] + [1] * (vocab - 264))
    w.add_token_merges(meta["tokenizer.ggml.merges"] + more_merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def q8(n: int, k: int) -> np.ndarray:
        blocks_ = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
        blocks_[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # every block's scale d
        return blocks_.reshape(n, -1)

    q, kv = heads * head_dim, kv_heads * head_dim
    w.add_tensor("token_embd.weight", q8(vocab, hidden), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(blocks):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, (n, k) in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", q8(n, k), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_MEASURE = """
import os, subprocess, sys
proc = subprocess.Popen([sys.executable, "-m", "jitllm", *sys.argv[1:]], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)
"""


def peak_rss_bytes(*args: str) -> int:
    """The peak RSS of `python -m jitllm ARGS`, by os.wait4 in a small parent process of its own (a child
    inherits its parent's RSS high-water mark across fork and exec, and pytest's is large)."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, env=ENV,
                          timeout=120, check=False)
    status, peak = (int(v) for v in done.stdout.split())
    assert status == 0, done.stderr
    return peak


def test_convert_memory_is_bounded_by_the_largest_region(tmp_path):
    """Issue 27 class 8: peak RSS <= the interpreter's baseline + 1.5 x the largest block region + the
    embedding, on a ~230 MB model (the gathering writer needed the whole output: ~250 MB over the bound)."""
    small = write_q8_gguf(tmp_path / "small.gguf", blocks=1)
    baseline = peak_rss_bytes("convert", str(small), "-o", str(tmp_path / "small.jlm"), "-quiet")
    big = write_q8_gguf(tmp_path / "big.gguf", blocks=16, hidden=1024, ffn=4096, vocab=8192, heads=16, kv_heads=4)
    peak = peak_rss_bytes("convert", str(big), "-o", str(tmp_path / "big.jlm"), "-quiet")
    out = JlmFile(tmp_path / "big.jlm")
    largest_block = max(r.size for name, r in out.regions.items() if name.startswith("block."))
    embedding = sum(t.nbytes for name, t in out.tensors.items() if name.startswith("token_embd."))
    bound = baseline + 1.5 * largest_block + embedding
    assert (tmp_path / "big.jlm").stat().st_size > 200e6
    assert peak <= bound, f"peak {peak / 1e6:.0f} MB > bound {bound / 1e6:.0f} MB (baseline {baseline / 1e6:.0f} MB)"


def test_convert_memory_with_a_large_vocabulary_holds_neither_the_embedding_nor_the_vocabulary_twice(tmp_path):
    """Issue 27 class 8 on a model shaped like the built-in SmolLM2 (49,152 tokens, ~49k merges, a 30 MB
    Q8_0 embedding, small blocks): peak RSS <= baseline + 1.5 x the largest block region + the embedding.
    Holding the embedding's parts whole while writing them, or the tokenizer build's Python lists (two
    strings per merge, the GGUF's lists beside the tokenizer's JSON), each went past it."""
    small = write_q8_gguf(tmp_path / "small.gguf", blocks=1)
    baseline = peak_rss_bytes("convert", str(small), "-o", str(tmp_path / "small.jlm"), "-quiet")
    big = write_q8_gguf(tmp_path / "big.gguf", blocks=2, hidden=576, ffn=1536, vocab=49152, heads=9, kv_heads=3,
                        merges=48000)
    peak = peak_rss_bytes("convert", str(big), "-o", str(tmp_path / "big.jlm"), "-quiet")
    out = JlmFile(tmp_path / "big.jlm")
    largest_block = max(r.size for name, r in out.regions.items() if name.startswith("block."))
    embedding = sum(t.nbytes for name, t in out.tensors.items() if name.startswith("token_embd."))
    bound = baseline + 1.5 * largest_block + embedding
    assert embedding > 30e6 and len(out.header["tokenizer"]) > 1e6
    assert peak <= bound, f"peak {peak / 1e6:.1f} MB > bound {bound / 1e6:.1f} MB (baseline {baseline / 1e6:.1f} MB)"


# --- class 1: the output path ---

def _device_node(path: Path) -> Path:
    """A character device like /dev/full (1, 7), made here; a test that needs one fails rather than skips
    under CI=true when it cannot be made."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        if os.environ.get("CI") == "true":
            pytest.fail("cannot make a device node with mknod (CI=true: the test must run)")
        pytest.skip("mknod is not permitted here")
    return path


@pytest.mark.parametrize("target", ["device", "link-to-device", "fifo", "directory", "source"])
def test_convert_never_replaces_what_is_not_a_regular_file_nor_the_source(tmp_path, target):
    src = write_q8_gguf(tmp_path / "m.gguf", blocks=1)
    out = tmp_path / "out"
    if target == "device":
        _device_node(out)
    elif target == "link-to-device":
        out.symlink_to(_device_node(tmp_path / "full"))
    elif target == "fifo":
        os.mkfifo(out)
    elif target == "directory":
        out.mkdir()
    else:
        out = src
    before = {p.name: (p.lstat().st_mode, p.lstat().st_size) for p in tmp_path.iterdir()}
    done = jitllm("convert", str(src), "-o", str(out), "-quiet")
    one_line_error(done, "cannot write")
    assert {p.name: (p.lstat().st_mode, p.lstat().st_size) for p in tmp_path.iterdir()} == before
    if target == "device":
        assert stat.S_ISCHR(out.lstat().st_mode)


def test_convert_writes_through_a_link_to_a_regular_file(tmp_path):
    src = write_q8_gguf(tmp_path / "m.gguf", blocks=1)
    real = tmp_path / "models" / "real.jlm"
    real.parent.mkdir()
    real.write_bytes(b"old")
    (tmp_path / "link.jlm").symlink_to(real)
    done = jitllm("convert", str(src), "-o", str(tmp_path / "link.jlm"), "-quiet")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "link.jlm").is_symlink() and JlmFile(real).header["config"]["num_blocks"] == 1


# --- class 2: interruptions ---

def _wait_for(predicate, what: str, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigterm_during_convert_is_one_line_and_leaves_no_temporary_file(tmp_path):
    src = write_q8_gguf(tmp_path / "big.gguf", blocks=8, hidden=1024, ffn=4096, vocab=8192, heads=16, kv_heads=4)
    out = tmp_path / "out" / "m.jlm"
    out.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "jitllm", "convert", str(src), "-o", str(out), "-quiet"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = f".m.jlm.{proc.pid}@{socket.gethostname()}."

    def writing() -> bool:
        return any(p.name.startswith(prefix) and p.stat().st_size > 10_000_000 for p in out.parent.iterdir())

    _wait_for(writing, "the temporary file")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and stderr == "jitllm: error: terminated\n", (proc.returncode, stderr)
    assert list(out.parent.iterdir()) == []


def _forks(pid: int) -> list[int]:
    """The children of `pid` that are forks of it (the same command line: the compile child; not the
    other programs a command may run, such as pyenv's shim lookups)."""
    def cmdline(p: int | str) -> bytes:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split() if cmdline(c) == cmdline(pid)]


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # (the compile child leads its own process group: it and its link step)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_during_a_compile_ends_it_and_leaves_nothing(tmp_path):
    """The compile runs in a child (jitllm/lowering/compile_child.py): SIGTERM mid-compile ends the
    command with one line and 143, the child and its process group are gone, nothing is left in the cache
    (no artifact, no temporary directory). tests/lowering/test_compile_child.py shows it ends before
    the work would have."""
    from jitllm.random_model import write_random_model

    model, cache = tmp_path / "tiny.jlm", tmp_path / "cache"
    write_random_model(model, "tiny", "q4_1", seed=1)
    proc = subprocess.Popen([sys.executable, "-m", "jitllm", "compile", "-cache", str(cache), str(model)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _forks(proc.pid), "the compile child", seconds=120)
        child = _forks(proc.pid)[0]
    finally:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and stderr == "jitllm: error: terminated\n", (proc.returncode, stderr)
    assert _gone(child)
    kept = {".locks", ".keys"}  # (compile locks: empty, the next compile takes them; keys: whole, atomic writes)
    left = [p for p in cache.rglob("*") if (not p.is_dir() or p.name.startswith(".")) and not kept & set(p.relative_to(cache).parts)]
    assert left == []


def test_a_later_convert_sweeps_dead_writers_temporary_files_but_not_live_ones(tmp_path):
    src = write_q8_gguf(tmp_path / "m.gguf", blocks=1)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    try:
        stale = tmp_path / f".m.jlm.{dead}@{host}.abcd1234.tmp"
        running = tmp_path / f".m.jlm.{live.pid}@{host}.efgh5678.tmp"
        elsewhere = tmp_path / f".m.jlm.{dead}@not-{host}.ijkl9012.tmp"
        other = tmp_path / f".other.jlm.{dead}@{host}.mnop3456.tmp"
        for planted in (stale, running, elsewhere, other):
            planted.write_bytes(b"x" * 1000)
        done = jitllm("convert", str(src), "-o", str(tmp_path / "m.jlm"), "-quiet")
        assert done.returncode == 0, done.stderr
        assert hidden_files(tmp_path) == sorted(p.name for p in (running, elsewhere, other))
    finally:
        live.kill()
        live.wait()
