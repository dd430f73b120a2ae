"""Requests as OpenAI's schemas define them, checked field by field: unknown fields are ignored, a known field
with a bad type or range is a 400 naming it, and a known field this server does not do (tools, ...) is a 400
saying so. Sampling defaults are OpenAI's (temperature 1, top_p 1, no top-k)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jitllm.runtime.sampling import SamplingParams
from jitllm.server.errors import ApiError

MAX_N = 16
MAX_STOPS = 16
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""Chat roles a template gets (OpenAI's `developer` is the system role of earlier models)."""


@dataclass(frozen=True)
class GenerationRequest:
    """What both endpoints ask for. `prompts`: chat, one list of {role, content} messages; completions, one
    entry per prompt (text or token ids). `top_logprobs`: how many alternatives each token's logprob comes
    with, None for no logprobs."""

    model: str | None
    prompts: list
    max_tokens: int | None
    sampling: SamplingParams
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    ignore_eos: bool


def _bad(name: str, wanted: str, value: Any) -> ApiError:
    return ApiError(400, f"'{name}' must be {wanted} (got {value!r})"[:300], param=name)


def _number(body: dict, name: str, default: float | None, low: float, high: float = math.inf,
            open_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or value > high or (open_low and value == low):
        bounds = f"{'>' if open_low else '>='} {low:g}" + ("" if high == math.inf else f" and <= {high:g}")
        raise _bad(name, f"a number {bounds}", value)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise _bad(name, f"an integer >= {low}" + ("" if high is None else f" and <= {high}"), value)
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _unsupported(body: dict, name: str, allowed: tuple = (None,)) -> None:
    value = body.get(name)
    if value not in allowed and not (isinstance(value, (list, dict)) and not value and None in allowed):
        raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOPS} of them", value)
    return tuple(stops)


def _common(body: dict, prompts: list, top_logprobs: int | None) -> GenerationRequest:
    """The fields both endpoints share."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    for name in ("tools", "functions", "logit_bias", "prediction", "audio"):
        _unsupported(body, name)
    _unsupported(body, "tool_choice", (None, "none", "auto"))
    _unsupported(body, "function_call", (None, "none", "auto"))
    _unsupported(body, "modalities", (None, ["text"]))
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ApiError(400, "'response_format' other than text is not supported by this server",
                       param="response_format", code="unsupported_parameter")
    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    max_tokens = _integer(body, "max_tokens", max_tokens, 1)
    top_k = _integer(body, "top_k", 0, -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", "an integer", seed)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0), top_k=max(top_k, 0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True), seed=seed,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0))
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "an object", options)
    include_usage = _boolean(options or {}, "include_usage") if stream else False
    return GenerationRequest(model, prompts, max_tokens, sampling, _integer(body, "n", 1, 1, MAX_N), _stop(body),
                             stream, include_usage, top_logprobs, _boolean(body, "ignore_eos"))


def _content(message: dict, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" for p in content):
            raise ApiError(400, f"{where}: only text content parts are supported by this server", param="messages",
                           code="unsupported_parameter")
        if not all(isinstance(p.get("text"), str) for p in content):
            raise _bad(f"{where}.content", "text parts with a string 'text'", content)
        return "".join(p["text"] for p in content)
    raise _bad(f"{where}.content", "a string or a list of text parts", content)


def parse_chat(body: Any) -> GenerationRequest:
    """POST /v1/chat/completions."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages", messages)
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "an object with 'role' and 'content'", message)
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls"):
            raise ApiError(400, f"{where}: tool messages are not supported by this server", param="messages",
                           code="unsupported_parameter")
        if role not in ROLES:
            raise _bad(f"{where}.role", "one of " + ", ".join(ROLES), role)
        conversation.append({"role": ROLES[role], "content": _content(message, where)})
    top = None
    if _boolean(body, "logprobs"):
        top = _integer(body, "top_logprobs", 0, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return _common(body, [conversation], top)


def parse_completion(body: Any) -> GenerationRequest:
    """POST /v1/completions: `prompt` is a string, a list of strings, a list of token ids or a list of those."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise _bad("prompt", "a string, a list of strings, a list of token ids or a list of those", prompt)
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "suffix", (None, ""))
    _unsupported(body, "best_of", (None, 1))
    return _common(body, prompts, _integer(body, "logprobs", None, 0, 5))


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in value)
