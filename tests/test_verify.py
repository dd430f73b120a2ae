"""verify's verdicts: agreement, near-ties and real differences, and the CLI on the host's two kernel families."""

from __future__ import annotations

import numpy as np

from jitllm.verify import compare


def test_verdicts():
    base = np.array([1.0, 3.0, 2.99, -1.0], np.float32)
    assert compare(base, base + 1e-4, 5, 1e-2).verdict == "ok"
    flipped = base.copy()
    flipped[2] = 3.001  # a near-tie: host margin 0.01, difference 0.011
    near = compare(base, flipped, 5, 1e-2)
    assert near.verdict == "near-tie" and near.host_top1 == 1 and near.device_top1 == 2
    wrong = base.copy()
    wrong[0] = 9.0
    assert compare(base, wrong, 5, 1e-2).verdict == "error"
    drift = base + np.array([0, 0.5, 0, 0], np.float32)
    assert compare(base, drift, 5, 1e-2).verdict == "error"  # same argmax, difference over 10 x tol


def test_verify_cli_same_kernels_agree(tiny_model, cache_dir):
    from test_cli import jitllm

    out = jitllm("verify", "-devices", "cpu", "-cpu-kernels", "exact", "-n", "6", str(tiny_model), "hello", cache=cache_dir)
    assert out.returncode == 0, out.stderr
    assert "compared 6 positions" in out.stdout and "max |dlogit| 0" in out.stdout


def test_verify_cli_fast_against_exact_uses_the_fast_kernels_tolerance(tiny_model, cache_dir):
    from test_cli import jitllm

    out = jitllm("verify", "-devices", "cpu", "-cpu-kernels", "fast", "-n", "6", str(tiny_model), "hello", cache=cache_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(fast host kernels)" in out.stdout and "(tol 0.25)" in out.stdout
    strict = jitllm("verify", "-devices", "cpu", "-cpu-kernels", "fast", "-tol", "0.001", "-n", "6", str(tiny_model),
                    "hello", cache=cache_dir)
    assert strict.returncode == 1 and "differ beyond a near-tie" in strict.stderr
