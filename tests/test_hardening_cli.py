"""The CLI against hostile input (issue 27, classes 5, 6, 7 and 10): flags and prompts that used to crash,
paths that used to hang, generation at the end of the context, and messages. The verbs run in this process
(click's runner) on the tiny random model; only the broken pipe needs a process of its own."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from jitllm.cli import MAX_MESSAGE, main
from jitllm.core.jlm import JlmFile
from jitllm.core.jlm_writer import RegionPlan, TensorSpec, write_jlm

CPU = ("-devices", "cpu")


@pytest.fixture(autouse=True)
def _cache(cache_dir, monkeypatch):
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(cache_dir))


def cli(*args: str, input: bytes | str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input)


def assert_one_line_error(result: Result, *needles: str) -> str:
    """Exit code 2 and one `jitllm: error:` line last on stderr (only `jitllm: ` notes before it)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert lines and lines[-1].startswith("jitllm: error: "), result.stderr
    assert all(line.startswith("jitllm: ") and "error:" not in line for line in lines[:-1]), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def rewritten(src: Path, dst: Path, edit) -> Path:
    """A copy of a .jlm whose header `edit(meta)` changed (the same tensors)."""
    f = JlmFile(src)
    meta = {k: v for k, v in f.header.items() if k not in ("tensors", "regions")}
    edit(meta)
    plans = []
    for region in f.header["regions"]:
        items = list(f.region_tensors(region["name"]).items())
        specs = tuple(TensorSpec(name, tuple(a.shape), a.dtype.name) for name, a in items)
        plans.append(RegionPlan(region["name"], specs, lambda items=items: items))
    write_jlm(dst, meta, plans)
    return dst


def test_seed_minus_one_is_random_and_numbers_that_cannot_sample_are_one_line(tiny_model):
    """-seed -1 (llama.cpp's "random") draws a fresh seed each run, -seed N repeats; nan, inf and a
    temperature too small for float32 are refused or sampled, never a traceback."""
    hot = ("run", *CPU, "-n", "24", "-temp", "30", "-top-k", "0", "-top-p", "1")
    randoms = [cli(*hot, "-seed", "-1", str(tiny_model), "hi") for _ in range(2)]
    seeded = [cli(*hot, "-seed", "5", str(tiny_model), "hi") for _ in range(2)]
    assert all(r.exit_code == 0 for r in randoms + seeded), [r.stderr for r in randoms + seeded]
    assert randoms[0].stdout != randoms[1].stdout and seeded[0].stdout == seeded[1].stdout
    tiny = cli("run", *CPU, "-n", "6", "-temp", "1e-320", str(tiny_model), "hi")
    greedy = cli("run", *CPU, "-n", "6", "-temp", "0", str(tiny_model), "hi")
    assert tiny.exit_code == 0 and tiny.stdout == greedy.stdout, tiny.stderr
    for flag, value in [("-temp", "nan"), ("-temp", "inf"), ("-top-p", "nan"), ("-seed", "-2")]:
        assert_one_line_error(cli("run", *CPU, flag, value, str(tiny_model), "hi"), value)
    assert_one_line_error(cli("verify", *CPU, "-tol", "nan", str(tiny_model)), "nan")


def test_text_that_is_not_utf8_is_refused_in_one_line(tiny_model, tmp_path):
    """Bytes that do not decode reach Python as lone surrogates (argv) or fail to decode (files, standard
    input): the prompt, -system, tokenize's TEXT and -f say which byte; chat leaves such a line out and goes on."""
    bad = "caf\udcc3 ok"  # (b"caf\xc3 ok" as Python decodes an argument)
    assert_one_line_error(cli("run", *CPU, str(tiny_model), bad), "the prompt is not valid UTF-8", "0xc3")
    assert_one_line_error(cli("run", *CPU, "-chat", "-system", bad, str(tiny_model), "hi"), "-system", "0xc3")
    assert_one_line_error(cli("tokenize", str(tiny_model), bad), "not valid UTF-8")
    (tmp_path / "p.txt").write_bytes(b"caf\xc3 ok")
    assert_one_line_error(cli("run", *CPU, "-f", str(tmp_path / "p.txt"), str(tiny_model)), "0xc3 at byte 3")
    assert_one_line_error(cli("run", *CPU, "-f", "-", str(tiny_model), input=b"caf\xc3 ok"), "0xc3 at byte 3")
    chat = cli("chat", *CPU, "-n", "4", "-temp", "0", str(tiny_model), input=b"caf\xc3 ok\nhello\n")
    assert chat.exit_code == 0, chat.stderr
    assert "jitllm: that line is not valid UTF-8 text (byte 0xc3 at character 3)" in chat.stderr
    assert chat.stderr.count("jitllm: prefill") == 1 and "Traceback" not in chat.stderr


def test_standard_output_on_a_full_disk_is_one_line_and_a_closed_pipe_ends_quietly(tiny_model, monkeypatch, capsys):
    """(Real descriptors: /dev/full, and a pipe whose reader has gone. What is left in the buffer must flush
    without an error afterwards, as the interpreter flushes it on the way out.)"""
    def run_into(stream) -> tuple[int, str]:
        monkeypatch.setattr(sys, "stdout", stream)
        with pytest.raises(SystemExit) as exit_:
            main(["run", *CPU, "-n", "8", str(tiny_model), "hi"])
        stream.flush()
        monkeypatch.undo()
        return exit_.value.code, capsys.readouterr().err

    code, err = run_into(io.TextIOWrapper(open("/dev/full", "wb")))
    assert code == 2 and err.splitlines()[-1] == "jitllm: error: cannot write to standard output: No space left on device"
    read, write = os.pipe()
    os.close(read)
    code, err = run_into(io.TextIOWrapper(open(write, "wb")))
    assert code == 0 and "error" not in err and "Traceback" not in err, err


def test_a_reader_that_goes_away_ends_the_process_with_exit_0(tiny_model, cache_dir):
    """`jitllm run ... | head -c 0`, as a process: exit 0, nothing on stderr but the statistics (no
    'Exception ignored' from the interpreter's last flush)."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "jitllm", "run", *CPU, "-n", "32", str(tiny_model), "hi"],
                            stdout=write, stderr=subprocess.PIPE, env=dict(os.environ, JITLLM_CACHE_DIR=str(cache_dir)))
    os.close(write)
    os.close(read)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"Traceback" not in err and b"Exception ignored" not in err, err.decode()


def test_a_model_path_that_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path):
    """A FIFO would block the open for ever (a writer opening it after 30 s turns a hang into a failure)."""
    fifo = tmp_path / "model.jlm"
    os.mkfifo(fifo)

    def unblock() -> None:
        if not done.wait(30):
            with open(fifo, "wb"):
                pass

    done = threading.Event()
    threading.Thread(target=unblock, daemon=True).start()
    try:
        for args in [("run", *CPU, str(fifo), "hi"), ("tokenize", str(fifo), "hi"), ("speed", *CPU, str(fifo)),
                     ("compile", str(fifo)), ("verify", *CPU, str(fifo))]:
            assert_one_line_error(cli(*args), f"{fifo} is a FIFO, not a model file")
    finally:
        done.set()
    assert_one_line_error(cli("run", *CPU, str(tmp_path), "hi"), "is a directory")
    assert_one_line_error(cli("run", *CPU, "/dev/null", "hi"), "/dev/null is a character device")


def test_generation_ends_at_the_context_with_a_note(tiny_model):
    """run: -n past the context stops there, says so on stderr and exits 0; chat: an answer the context cuts
    short says so, a message with no room left is refused with a note and the chat goes on; speed: a test
    longer than the context measures what fits and says so."""
    run = cli("run", *CPU, "-n", "100", "-ctx", "16", "-temp", "0", str(tiny_model), "hi")
    assert run.exit_code == 0, run.stderr
    assert "jitllm: the context of 16 tokens is full: generation stopped there (-ctx gives up to the model's 256)" \
        in run.stderr
    assert "decode 15 tokens" in run.stderr
    chat = cli("chat", *CPU, "-n", "100", "-ctx", "40", "-temp", "0", str(tiny_model),
               input="hi\nand a second message that cannot fit\n")
    assert chat.exit_code == 0, chat.stderr
    assert "jitllm: the context of 40 tokens is full" in chat.stderr
    assert "jitllm: that message does not fit: the conversation would take" in chat.stderr
    speed = cli("speed", *CPU, "-p", "20", "-n", "40", "-r", "1", "-ctx", "16", str(tiny_model))
    assert speed.exit_code == 0, speed.stderr
    assert [row.split("|")[4].strip() for row in speed.stdout.splitlines() if row.startswith("| tiny")] == \
        ["pp16", "tg15"]
    assert "jitllm: tg40 does not fit the context of 16 tokens: measuring tg15" in speed.stderr


def test_messages_say_what_to_do(tiny_model, tmp_path):
    """A prompt that begins with '-' (and how to pass it: after --), -vram where there is no device, -system
    without -chat, a 100 KB value echoed in part, a model whose own context is 0, and an unexpected error:
    each one line."""
    hint = "text that begins with '-' goes after --: jitllm run [OPTIONS] -- [MODEL] PROMPT"
    assert_one_line_error(cli("run", *CPU, str(tiny_model), "-hello"), "no such option: -hello", hint)
    typo = assert_one_line_error(cli("run", "-devicez", "cpu", str(tiny_model), "hi"), "no such option: -devicez")
    assert typo.endswith("(did you mean -devices?)"), typo
    dashed = cli("run", *CPU, "-n", "2", "--", str(tiny_model), "-hello")
    assert dashed.exit_code == 0, dashed.stderr
    assert_one_line_error(cli("run", *CPU, "-vram", "2G", str(tiny_model), "hi"), "-vram 2G", "-devices cpu")
    assert_one_line_error(cli("run", *CPU, "-system", "be brief", str(tiny_model), "hi"), "-chat")
    huge = "x" * 100_000
    line = assert_one_line_error(cli("run", *CPU, "-placement", huge, str(tiny_model), "hi"), "characters ...]")
    assert len(line) <= len("jitllm: error: ") + MAX_MESSAGE
    zero = rewritten(tiny_model, tmp_path / "ctx0.jlm", lambda meta: meta["config"].update(context=0))
    line = assert_one_line_error(cli("run", *CPU, str(zero), "hi"), "context", "0")
    assert "None" not in line
    extra = rewritten(tiny_model, tmp_path / "extra.jlm", lambda meta: meta["config"].update(colour="blue"))
    assert "missing" not in assert_one_line_error(cli("run", *CPU, str(extra), "hi"))


def test_an_unexpected_exception_is_one_line_too(tiny_model, monkeypatch):
    import jitllm.tokenizer

    def broken(path):
        raise KeyError("vocab")

    monkeypatch.setattr(jitllm.tokenizer, "load_tokenizer", broken)
    assert_one_line_error(cli("tokenize", str(tiny_model), "hi"), "internal error: KeyError: 'vocab'",
                          "JITLLM_TRACEBACK=1")
