"""jitllmd's command line: every bad flag, a non-loopback address without a key, a port in use and a model
that cannot load are one line `jitllmd: error: ...` and exit code 2; nothing is bound off loopback."""

from __future__ import annotations

import socket

import pytest
from jitllmd_process import jitllmd


def assert_one_line_error(result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("jitllmd: error:") and "Traceback" not in result.stderr, result.stderr
    assert all(line.startswith("jitllmd: ") for line in lines), result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def test_help_lists_the_verbs(cache_dir):
    out = jitllmd("--help", cache=cache_dir)
    assert out.returncode == 0 and all(verb in out.stdout for verb in ("serve", "models", "sessions", "place"))


@pytest.mark.parametrize("args, needle", [
    (("-port", "70000"), "70000"),
    (("-parallel", "0"), "0"),
    (("-queue", "many"), "many"),
    (("-cache-kv", "lots"), "lots"),
    (("-prefill-stretch", "-1"), "-1"),
    (("-cache-sessions", "2", "-parallel", "4"), "fewer"),
    (("-placement", "3-1=host"), "backwards"),
    (("-bogus",), "-bogus"),
])
def test_bad_flags(tiny_model, cache_dir, args, needle):
    assert_one_line_error(jitllmd("serve", str(tiny_model), *args, cache=cache_dir), needle)


def test_a_missing_model_file(tmp_path, cache_dir):
    assert_one_line_error(jitllmd("serve", str(tmp_path / "none.jlm"), cache=cache_dir), "not found")


def test_a_non_loopback_address_needs_a_key(tiny_model, cache_dir):
    assert_one_line_error(jitllmd("serve", str(tiny_model), "-host", "0.0.0.0", cache=cache_dir), "-api-key")


def test_a_port_in_use(tiny_model, cache_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert_one_line_error(jitllmd("serve", str(tiny_model), "-port", port, cache=cache_dir), "cannot listen", port)


def test_a_model_that_cannot_load_ends_the_server(tiny_model, cache_dir):
    """The load runs behind the started server; its failure still ends the process in one line."""
    out = jitllmd("serve", str(tiny_model), "-port", "0", "-devices", "gpu:7", cache=cache_dir, timeout=300)
    assert_one_line_error(out, "gpu")


def test_a_client_verb_without_a_server(cache_dir):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}"
    assert_one_line_error(jitllmd("models", "-url", url, cache=cache_dir), "cannot reach", url)
