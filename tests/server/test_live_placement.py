"""Live placement on simulated devices (`-devices sim:0,sim:1`, JITLLM_SIM_DEVICES=1): moves posted while temp-0
streams run are applied between two steps with every session's pages, and each stream's text and logprobs
are those of a run without moves; a bad move moves nothing. The client verbs print the server's tables."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from jitllmd_process import jitllmd, start

SIM = {"JITLLM_SIM_DEVICES": "1"}
PROMPTS = [f"moving prompt {i} ends in {c}" for i, c in enumerate("klmn")]


@pytest.fixture(scope="module")
def server(tiny_model, cache_dir):
    served = start(tiny_model, cache_dir, "-devices", "sim:0,sim:1", "-placement", "0=sim:0,1=sim:1", "-parallel", "4",
                   env=SIM)
    yield served
    assert served.stop() == 0, "".join(served.stderr)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=server.url + "/v1", max_retries=0, timeout=120)


def placement(server) -> dict[str, str]:
    return {u["unit"]: u["device"] for u in httpx.get(server.url + "/v1/placement", timeout=60).json()["units"]}


def move(server, spec: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/placement", json={"moves": spec}, timeout=60)


def streamed(client, prompt: str, arrivals: list[float]) -> tuple[str, list[float]]:
    text, logprobs = "", []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=200, temperature=0, logprobs=1,
                                           stream=True):
        choice = chunk.choices[0]
        arrivals.append(time.monotonic())
        text += choice.text
        logprobs += choice.logprobs.token_logprobs if choice.logprobs else []
    return text, logprobs


def test_the_placement_is_the_plan(server):
    assert placement(server) == {"0": "sim:0", "1": "sim:1", "head": "sim:1"}
    answer = httpx.get(server.url + "/v1/placement", timeout=60).json()
    assert {d["name"] for d in answer["devices"]} == {"host", "sim:0", "sim:1"} and "seam" in answer["plan"]


def test_moves_during_streams_change_no_stream(server, client):
    alone = [streamed(client, p, []) for p in PROMPTS]
    arrivals: list[list[float]] = [[] for _ in PROMPTS]
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, streamed(client, PROMPTS[i], arrivals[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    while not all(arrivals):  # every stream has begun
        time.sleep(0.005)
    reports, applied = [], []
    for spec in ("0=sim:1", "1=host,head=sim:0", "0-1=sim:0,head=host", "*=sim:1,head=sim:1"):
        answer = move(server, spec)
        assert answer.status_code == 200, answer.text
        reports += answer.json()["moves"]
        applied.append(time.monotonic())
    for t in threads:
        t.join(120)
    assert placement(server) == {"0": "sim:1", "1": "sim:1", "head": "sim:1"}
    assert len(reports) == 9 and all(r["ms"] >= 0 and r["weight_bytes"] > 0 for r in reports)
    assert any(r["kv_bytes"] > 0 for r in reports)  # the streams' pages went along
    # (batched streams of the tiny model are quick: on a loaded machine the later moves may come after them,
    # but at least the first was applied while a stream still ran)
    assert any(times[-1] > applied[0] for times in arrivals), "every stream ended before the moves"
    for i, (text, logprobs) in enumerate(alone):
        assert results[i][0] == text and len(results[i][1]) == len(logprobs) == 200
        assert max(abs(a - b) for a, b in zip(results[i][1], logprobs)) < 1e-3


@pytest.mark.parametrize("spec, needle", [("0=sim:9", "sim:9"), ("1=host,0=nowhere", "nowhere"), ("0-5=host", "5"),
                                          ("0=host~", "stream")])
def test_a_bad_move_moves_nothing(server, spec, needle):
    before = placement(server)
    answer = move(server, spec)
    assert answer.status_code == 400 and needle in answer.json()["error"]["message"]
    assert placement(server) == before


def test_the_client_verbs_print_tables(server, cache_dir):
    url = ("-url", server.url)
    shown = jitllmd("place", *url, cache=cache_dir)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0].split() == ["UNIT", "DEVICE", "PLANNED", "PINNED", "WEIGHTS"]
    moved = jitllmd("place", "0=host", *url, cache=cache_dir)
    assert moved.returncode == 0 and moved.stdout.split()[:6] == ["UNIT", "FROM", "TO", "WEIGHTS", "KV", "MS"]
    assert placement(server)["0"] == "host"
    sessions = jitllmd("sessions", *url, cache=cache_dir)
    assert sessions.returncode == 0 and sessions.stdout.splitlines()[0].split()[:3] == ["SESSION", "STATE", "TOKENS"]
    assert len(sessions.stdout.splitlines()) > 1 and "host" in sessions.stdout  # (block 0's pages came home)
    models = jitllmd("models", *url, cache=cache_dir)
    assert models.returncode == 0 and models.stdout.splitlines()[1].split()[0] == "tiny"
    bad = jitllmd("place", "0=sim:9", *url, cache=cache_dir)
    assert bad.returncode == 2 and bad.stderr.startswith("jitllmd: error:") and "HTTP 400" in bad.stderr
