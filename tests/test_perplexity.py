"""`jitllm perplexity`: llama-perplexity's method (non-overlapping windows, the second half of each scored)
on a tiny random model, against a reference computed here from ONNX Runtime's logits; its bad inputs."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from jitllm.model import load
from jitllm.perplexity import Estimate, perplexity, scored_nll, windows
from test_cli import assert_one_line_error, jitllm

TEXT = Path(__file__).parent / "fixtures" / "newton-opticks.txt"
WINDOW = 64


def reference_ppl(model, text: str, ctx: int, chunks: int) -> float:
    """Windows, targets and log-softmax written out plainly, over logits from the ONNX Runtime device."""
    ex = model.executor
    tokens = model.tokenizer.encode(text, parse_special=False)
    nll = []
    for w in range(min(len(tokens) // ctx, chunks)):
        window = tokens[w * ctx:(w + 1) * ctx]
        logits = ex.prompt_logits(ex.new_session(), window).astype(np.float64)
        for pos in range(ctx // 2, ctx - 1):
            row = logits[pos]
            nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[window[pos + 1]])
    return math.exp(float(np.mean(nll)))


def test_perplexity_matches_a_reference_from_onnx_runtime_logits(tiny_model, cache_dir, tmp_path):
    text = TEXT.read_text(encoding="utf-8")[:1500]  # (the byte tokenizer: 1500 tokens, 23 windows)
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    out = jitllm("perplexity", str(tiny_model), str(tmp_path / "text.txt"), "-c", str(WINDOW), "-devices", "cpu",
                 "-cpu-kernels", "exact", cache=cache_dir)
    assert out.returncode == 0, out.stderr
    found = re.findall(r"\[(\d+)\]([0-9.]+),", out.stdout)
    assert [int(i) for i, _ in found] == list(range(1, 1500 // WINDOW + 1)), out.stdout
    running = [float(x) for _, x in found]
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout)
    assert final, out.stdout
    ppl, error = float(final.group(1)), float(final.group(2))
    assert math.isfinite(ppl) and ppl > 1 and 0 < error < ppl
    assert running[-1] == pytest.approx(ppl, rel=1e-6)
    ort = load(tiny_model, devices="ort", placement="*=ort,head=ort", ctx=WINDOW, cache_dir=cache_dir)
    assert math.log(ppl) == pytest.approx(math.log(reference_ppl(ort, text, WINDOW, 10 ** 9)), abs=1e-3)


def test_decode_steps_score_what_prefill_scores(tiny_model, cache_dir):
    model = load(tiny_model, devices="cpu", ctx=WINDOW, cache_dir=cache_dir, cpu_kernels="exact")
    tokens = model.tokenizer.encode(TEXT.read_text(encoding="utf-8")[:400], parse_special=False)
    chunks = windows(tokens, WINDOW, None)
    seen = []
    by_prefill = perplexity(model.executor, chunks, batch=24, on_window=lambda e: seen.append(e.windows))
    by_steps = perplexity(model.executor, chunks, batch=24, decode=True)
    assert seen == list(range(1, len(chunks) + 1)) and by_steps.count == by_prefill.count == len(chunks) * 31
    assert math.log(by_steps.ppl) == pytest.approx(math.log(by_prefill.ppl), abs=1e-4)
    assert not model.executor.sessions  # (each window's session closed)


def test_windows_replace_the_first_token_with_bos_where_the_model_adds_one():
    tokens = list(range(10, 31))
    assert windows(tokens, 8, None) == [list(range(10, 18)), list(range(18, 26))]
    assert windows(tokens, 8, 1) == [[1, *range(11, 18)], [1, *range(19, 26)]]
    with pytest.raises(Exception, match="21 tokens: a context of 11 needs at least 22"):
        windows(tokens, 11, None)


def test_scored_tokens_are_the_second_half_in_any_chunking():
    rng = np.random.default_rng(0)
    window, logits = list(rng.integers(0, 50, 12)), rng.standard_normal((12, 50)).astype(np.float32) * 4
    whole = scored_nll(logits, window, 0)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    assert np.allclose(whole, [-log_probs[p, window[p + 1]] for p in range(6, 11)])
    parts = np.concatenate([scored_nll(logits[a:a + 5], window, a) for a in range(0, 12, 5)])
    assert np.allclose(parts, whole)
    estimate = Estimate()
    estimate.add(whole)
    mean = whole.mean()
    assert estimate.ppl == pytest.approx(math.exp(mean))
    assert estimate.error == pytest.approx(whole.std() / math.sqrt(len(whole) - 1) * math.exp(mean))


@pytest.mark.parametrize("args, needle", [
    (("MISSING", "-c", "64"), "No such file or directory"),
    (("SHORT", "-c", "64"), "a context of 64 needs at least 128"),
    (("TEXT", "-c", "1024"), "-c 1024 is larger than the model's context of 256"),
    (("TEXT", "-c", "128", "-ctx", "64"), "-c 128 does not fit -ctx 64"),
])
def test_bad_inputs_are_one_line(args, needle, tiny_model, cache_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("a few words, fewer than two windows")
    paths = {"MISSING": str(tmp_path / "missing.txt"), "SHORT": str(short), "TEXT": str(TEXT)}
    out = jitllm("perplexity", str(tiny_model), *(paths.get(a, a) for a in args), "-devices", "cpu", cache=cache_dir)
    assert_one_line_error(out, needle)
    assert out.stdout == ""
