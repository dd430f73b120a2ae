"""Interactive chat (jitllm.chat, `jitllm chat`): the conversation's KV cache is kept between turns, the
answers those of recomputing the whole conversation, Ctrl-C stops an answer and not the program."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jitllm.chat import Conversation
from jitllm.model import load
from jitllm.runtime.sampling import SamplingParams

GREEDY = SamplingParams(0.0)


@pytest.mark.parametrize("model_name, reuses", [("tiny_model", True), ("tiny_hybrid_model", False)])
def test_a_turn_reuses_the_conversations_cache_and_answers_as_a_fresh_run(model_name, reuses, request, cache_dir):
    """A llama model runs only what its session lacks; a hybrid one (recurrent state cannot be cut back)
    runs the conversation again. Either way each answer is a fresh run's over the same conversation."""
    path = request.getfixturevalue(model_name)
    model = load(path, devices="cpu", ctx=256, cache_dir=cache_dir, cpu_kernels="exact")
    conversation = Conversation(model, system="be brief")
    for text in ("hello there", "and then?", "one more"):
        answer = "".join(conversation.say(text, 12, GREEDY))
        # (a session of its own: the whole conversation run from nothing)
        expected = "".join(model.generate(model.tokenizer.encode_chat(conversation.messages[:-1]), 12, GREEDY))
        assert answer == expected and conversation.messages[-1] == {"role": "assistant", "content": answer}
    assert (conversation.reused > 0) == reuses


def _default_sigint() -> None:
    """The chat's Ctrl-C as a terminal gives it: a suite started in the background of a shell without job
    control runs with SIGINT ignored, which its children inherit (and Python then leaves ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_chat_verb_keeps_the_cache_and_survives_an_interrupted_answer(cache_dir, tmp_path):
    """(A tiny model with a long context: its answers run for seconds, so the interrupt lands inside one.)"""
    from jitllm.random_model import PRESETS, write_random_model

    path = tmp_path / "long.jlm"
    write_random_model(path, dataclasses.replace(PRESETS["tiny"], context=16384), "q4_1", seed=1)
    env = dict(os.environ, JITLLM_CACHE_DIR=str(cache_dir))
    proc = subprocess.Popen([sys.executable, "-m", "jitllm", "chat", "-n", "4000", "-temp", "0", "-devices", "cpu",
                             "-ctx", "16384", str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, preexec_fn=_default_sigint)
    out = bytearray()

    def read() -> None:
        for byte in iter(lambda: proc.stdout.read(1), b""):
            out.extend(byte)

    threading.Thread(target=read, daemon=True).start()
    proc.stdin.write(b"hello\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while not out and time.monotonic() < deadline and proc.poll() is None:  # the answer streams
        time.sleep(0.1)
    assert out, "no answer streamed"
    proc.send_signal(signal.SIGINT)  # stops the answer, not the program
    proc.stdin.write(b"again\n/exit\n")
    proc.stdin.flush()
    _, err = proc.communicate(timeout=300)
    lines = err.decode().splitlines()
    assert proc.returncode == 0, err.decode()
    assert "jitllm: answer stopped" in lines and "Traceback" not in err.decode()
    stats = [line for line in lines if line.startswith("jitllm: prefill")]
    assert len(stats) == 2 and "(0 reused)" not in stats[1]
