"""`jitllm batch`: llama-batched-bench's table from batched steps, its JSON rows, and bad input."""

from __future__ import annotations

import json
import subprocess

from test_cli import assert_one_line_error, jitllm

COLUMNS = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"]


def test_batch_prints_the_table(tiny_model, cache_dir):
    result = jitllm("batch", str(tiny_model), "-devices", "cpu", "-b", "1,3", "-p", "6", "-n", "4", "-r", "1",
                    cache=cache_dir)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == COLUMNS
    rows = [[float(c) for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [(6, 4, 1, 10), (6, 4, 3, 30)]
    for pp, tg, b, n_kv, t_pp, s_pp, t_tg, s_tg, t, s in rows:
        assert t_pp > 0 and t_tg > 0 and s_pp > 0 and s_tg > 0 and abs(t - (t_pp + t_tg)) < 2e-3


def test_batch_json_rows(tiny_model, cache_dir):
    result = jitllm("batch", str(tiny_model), "-devices", "cpu", "-b", "2", "-p", "5", "-n", "3", "-r", "1", "-json",
                    cache=cache_dir)
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert (row["pp"], row["tg"], row["pl"], row["n_kv"]) == (5, 3, 2, 16)
    assert row["speed_pp"] == row["pl"] * row["pp"] / row["t_pp"] and row["speed_tg"] == row["pl"] * row["tg"] / row["t_tg"]
    assert row["t"] == row["t_pp"] + row["t_tg"] and row["speed"] == row["n_kv"] / row["t"]


def test_batch_bad_input(tiny_model, tiny_hybrid_model, cache_dir):
    assert_one_line_error(jitllm("batch", str(tiny_model), "-devices", "cpu", "-b", "1,x", cache=cache_dir), "batch sizes")
    assert_one_line_error(jitllm("batch", str(tiny_model), "-devices", "cpu", "-b", "0", cache=cache_dir), "1 to 1024")
    assert_one_line_error(jitllm("batch", str(tiny_model), "-devices", "cpu", "-p", "200", "-n", "100", "-ctx", "128",
                                 cache=cache_dir), "do not fit the context")
    hybrid = jitllm("batch", str(tiny_hybrid_model), "-devices", "cpu", "-b", "1", "-p", "4", "-n", "2", cache=cache_dir)
    assert hybrid.returncode != 0 and "recurrent state" in hybrid.stderr and "Traceback" not in hybrid.stderr


def test_batch_defaults_to_the_gpu(tiny_model, cache_dir):
    """As the reference system: `batch` runs on the GPU unless told otherwise; without one, one clear line."""
    import shutil

    result = jitllm("batch", str(tiny_model), "-b", "1", "-p", "4", "-n", "2", "-r", "1", cache=cache_dir)
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0:
        return  # (a GPU here: covered by tests/gpu)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()][-1].startswith("jitllm: error: gpu")
