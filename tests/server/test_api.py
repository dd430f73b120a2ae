"""jitllmd's OpenAI API as a client meets it: one real server on the CPU (with an API key, 3 slots and a queue
of 2) and the official `openai` client. Expected texts come from `jitllm run` or a solo request, never from
the test."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from jitllmd_process import start

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model, cache_dir):
    served = start(tiny_model, cache_dir, "-api-key", KEY, "-parallel", "3", "-queue", "2", "-cache-sessions", "8",
                   api_key=KEY)
    yield served
    assert served.stop() == 0, "".join(served.stderr)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from jitllm.core.jlm import JlmFile
    from jitllm.tokenizer import Tokenizer

    return Tokenizer.from_header(JlmFile(tiny_model).header)


def http(server, method: str, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, headers=headers | kwargs.pop("headers", {}), timeout=60, **kwargs)


def sampled(client, prompt: str = "hello", seed: int = 5, **kwargs):
    """A completion drawn at a high temperature (the tiny random model repeats its last token at low ones)."""
    args = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=30.0, seed=seed,
                extra_body={"ignore_eos": True}) | kwargs
    return client.completions.create(**args)


def test_health_said_503_and_the_stage_before_200(server):
    codes = [code for code, _ in server.health]
    assert codes[-1] == 200 and 503 in codes
    loading = [body for code, body in server.health if code == 503]
    assert all(body["stage"] == "loading" for body in loading), loading


def test_models_lists_the_file_stem_and_an_unknown_model_is_404(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])


def test_greedy_answers_are_jitllm_runs(client, tiny_model, cache_dir):
    """temperature 0 gives what `jitllm run -temp 0` prints (the same CPU kernel family), for a completion and
    a chat; the stream's pieces make the whole answer."""
    env = dict(os.environ, JITLLM_CACHE_DIR=str(cache_dir))
    for chat in (False, True):
        run = subprocess.run([sys.executable, "-m", "jitllm", "run", "-n", "12", "-temp", "0", "-devices", "cpu",
                              *(["-chat"] if chat else []), str(tiny_model), "hello there"],
                             capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr
        if chat:
            messages = [{"role": "user", "content": "hello there"}]
            whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            text = whole.choices[0].message.content
            stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                    stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            whole = client.completions.create(model="tiny", prompt="hello there", max_tokens=12, temperature=0)
            text = whole.choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt="hello there", max_tokens=12, temperature=0, stream=True))
        assert run.stdout == text + "\n" and streamed == text
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12


def test_a_seed_repeats_its_draws(client):
    first, again, other = sampled(client, seed=5), sampled(client, seed=5), sampled(client, seed=6)
    assert first.choices[0].text == again.choices[0].text != other.choices[0].text
    assert first.usage.completion_tokens == 24  # (ignore_eos: no stop token ends it early)


def test_n_choices_draw_from_consecutive_seeds(client):
    both = sampled(client, seed=5, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [sampled(client, seed=5).choices[0].text, sampled(client, seed=6).choices[0].text]
    assert both.usage.completion_tokens == 48 and both.usage.prompt_tokens == len("hello")


def test_stop_strings_end_the_text_before_them(client):
    solo = sampled(client, seed=7).choices[0].text
    at = next(i for i in range(3, len(solo)) if solo[i].isascii() and solo[i].isprintable() and solo[i] not in solo[:i])
    for stop in (solo[at], ["never-there", solo[at:at + 2]]):
        cut = sampled(client, seed=7, stop=stop)
        assert cut.choices[0].text == solo[:at] and cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens < 24
        streamed = "".join(c.choices[0].text for c in sampled(client, seed=7, stop=stop, stream=True))
        assert streamed == solo[:at]


def test_logprobs_in_both_shapes(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content and len(content) == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob == tops[0]  # (greedy)
        assert sum(math.exp(lp) for lp in tops) <= 1 + 1e-9 and bytes(entry.bytes).decode() == entry.token
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) >= chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))


def test_usage_counts_and_a_follow_up_turn_is_cached(server, client, tokenizer):
    messages = [{"role": "system", "content": "unique system prompt for the cache test"},
                {"role": "user", "content": "first turn"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    prompt = len(tokenizer.encode_chat(messages))
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (prompt, 6)
    assert first.usage.total_tokens == prompt + 6 and first.usage.prompt_tokens_details.cached_tokens == 0
    follow = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "second turn"}]
    second = client.chat.completions.create(model="tiny", messages=follow, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= prompt
    listed = http(server, "GET", "/v1/sessions").json()["data"]
    assert any(s["state"] == "idle" and s["tokens"] >= prompt and s["pages"].get("host", 0) > 0 for s in listed)


def test_a_stream_ends_with_usage_and_done(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_max_tokens_past_the_context_is_clamped(client):
    answer = client.completions.create(model="tiny", prompt="hello", max_tokens=100000, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 256  # the tiny model's context


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400,
     "lone surrogate"),
    ("/v1/chat/completions", [1, 2], 400, "JSON object"),
    ("/v1/chat/completions", CHAT | {"temperature": "hot"}, 400, "'temperature'"),
    ("/v1/chat/completions", CHAT | {"temperature": -0.5}, 400, "'temperature'"),
    ("/v1/chat/completions", CHAT | {"top_p": 0}, 400, "'top_p'"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 0}, 400, "'max_tokens'"),
    ("/v1/chat/completions", CHAT | {"n": True}, 400, "'n'"),
    ("/v1/chat/completions", CHAT | {"stop": [""]}, 400, "'stop'"),
    ("/v1/chat/completions", CHAT | {"messages": []}, 400, "'messages'"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400, "'logprobs'"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs'"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "not supported"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}, 400, "not supported"),
    ("/v1/chat/completions", CHAT | {"model": "gpt-5"}, 404, "does not exist"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "x " * 300}]}, 400, "context"),
    ("/v1/completions", {"prompt": 5}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": [999999]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "not supported"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, 400, "'logprobs'"),
    ("/v1/completions", {"prompt": "hi", "n": 6}, 400, "at once"),
    ("/v1/completions", {"prompt": "x" * (5 << 20)}, 413, "over"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, needle):
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    answer = http(server, "POST", path, **sent)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert needle in error["message"] and error["type"] and "Traceback" not in answer.text


def test_unknown_fields_are_ignored_and_routes_answer_in_json(server):
    assert http(server, "POST", "/v1/chat/completions", json=CHAT | {"frobnicate": 3, "user": "me"}).status_code == 200
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        answer = http(server, method, path)
        assert answer.status_code == status and "message" in answer.json()["error"]


def test_every_endpoint_needs_the_key(server):
    for path in ("/health", "/metrics", "/v1/models", "/v1/sessions", "/v1/placement"):
        assert http(server, "GET", path, key=None).status_code == 401
        assert http(server, "GET", path, key="wrong").status_code == 401
        assert http(server, "GET", path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=server.url + "/v1", max_retries=0).models.list()


def busy_sessions(server) -> list[dict]:
    return [s for s in http(server, "GET", "/v1/sessions").json()["data"] if s["state"] == "busy"]


def session_tokens(server) -> dict[int, int]:
    return {s["id"]: s["tokens"] for s in http(server, "GET", "/v1/sessions").json()["data"]}


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    """Three choices streamed, the client gone after three events: every slot is let go long before its
    choice's 240 tokens (the sessions they leave in the cache hold what was generated)."""
    before = session_tokens(server)
    body = {"prompt": "leaving early", "max_tokens": 240, "temperature": 0, "stream": True, "n": 3}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as answer:
        lines = answer.iter_lines()
        assert [next(lines) for _ in range(3)][0].startswith("data: ")
    deadline = time.monotonic() + 10
    while busy_sessions(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert busy_sessions(server) == []
    mine = [tokens for session, tokens in session_tokens(server).items() if session not in before]
    assert len(mine) == 3 and max(mine) < len("leaving early") + 200, mine


def test_concurrent_streams_each_get_their_solo_answer(client):
    """Five streams at once (3 slots, 2 waiting): each stream's text and logprobs are those its prompt gets alone."""
    prompts = [f"prompt number {i} ends with {c}" for i, c in enumerate("vwxyz")]

    def ask(prompt: str, stream: bool):
        args = dict(model="tiny", prompt=prompt, max_tokens=20, temperature=0, logprobs=1)
        if not stream:
            choice = client.completions.create(**args).choices[0]
            return choice.text, choice.logprobs.token_logprobs
        chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
        return "".join(c.text for c in chunks), [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]

    solo = [ask(p, False) for p in prompts]
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(prompts[i], True))) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len({text for text, _ in solo}) == 5
    for i, (text, logprobs) in enumerate(solo):
        assert results[i][0] == text
        assert max(abs(a - b) for a, b in zip(results[i][1], logprobs)) < 1e-3


def test_a_full_queue_answers_429_with_retry_after(server):
    """Sixteen requests at once for 3 slots and a queue of 2: the first five are served, and the ones that find
    the queue full get 429 with Retry-After (none is dropped or fails otherwise)."""
    answers: list[httpx.Response] = []

    def ask(i: int) -> None:
        answers.append(http(server, "POST", "/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 240}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = [a.status_code for a in answers]
    assert len(codes) == 16 and set(codes) == {200, 429} and codes.count(200) >= 5, codes
    refused = [a for a in answers if a.status_code == 429]
    assert all(a.headers["retry-after"] == "1" and a.json()["error"]["type"] == "rate_limit_error" for a in refused)


def test_metrics_count_requests_tokens_latency_and_kv(server):
    text = http(server, "GET", "/metrics").text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert samples['jitllm_requests_total{route="/v1/completions",status="200"}'] > 0
    assert samples['jitllm_requests_total{route="/v1/completions",status="429"}'] >= 1
    assert samples["jitllm_generated_tokens_total"] > 100 and samples["jitllm_cached_prompt_tokens_total"] > 0
    assert samples["jitllm_time_to_first_token_seconds_count"] > 0 and samples["jitllm_inter_token_latency_seconds_count"] > 0
    assert samples['jitllm_kv_pages{device="host"}'] > 0 and samples['jitllm_kv_bytes{device="host"}'] > 0
    assert "jitllm_queue_depth" in samples and "jitllm_moves_total" in samples
    # the concurrent streams above were served by batched steps of several slots each
    assert samples["jitllm_batched_steps_total"] > 0
    assert samples["jitllm_batched_sessions_total"] >= 2 * samples["jitllm_batched_steps_total"]


def test_sigterm_lets_a_stream_finish_and_exits_0(server):
    """(Last: it stops the module's server.) SIGTERM mid-stream: the stream still ends with [DONE], new
    connections are refused, the process exits 0."""
    body = {"prompt": "until the end", "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as answer:
        lines = answer.iter_lines()
        next(lines)
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(60) == 0
    with pytest.raises(httpx.TransportError):
        http(server, "GET", "/health")
