"""`jitllmd` verbs: `serve [MODEL]` (OpenAI's HTTP API over the engine), and `models`, `sessions`, `place` that
talk to a running server. The server itself is jitllm.server; these parse flags and call it."""

from __future__ import annotations

import os
from pathlib import Path

import click

from jitllm.commands.common import load_model, opt, placement_options, regular_file

API_KEY_ENV = "JITLLMD_API_KEY"


def _api_key_option(func):
    return opt("api-key", "api_key", default=None, envvar=API_KEY_ENV, show_envvar=True,
               help="the API key (every request then needs Authorization: Bearer KEY)")(func)


def _size(value: str | None, flag: str) -> int | None:
    from jitllm.core.errors import JitllmError
    from jitllm.runtime.device_spec import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except (JitllmError, ValueError):
        raise click.UsageError(f"{flag} {value!r}: expected a size such as 512M or 2G") from None


@click.command()
@click.argument("model_path", required=False, metavar="[MODEL]")
@opt("host", default="127.0.0.1", show_default=True, help="address to listen on")
@opt("port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="port (0: a free one)")
@opt("parallel", type=click.IntRange(min=1), default=4, show_default=True, help="requests generating at once")
@opt("queue", "queue_size", type=click.IntRange(min=0), default=64, show_default=True,
     help="requests waiting for a slot (beyond: 429)")
@opt("alias", default=None, help="the model's name in the API (default: the file's stem)")
@_api_key_option
@opt("insecure", is_flag=True, help="allow a non-loopback -host without -api-key")
@opt("cache-sessions", "cache_sessions", type=click.IntRange(min=1), default=32, show_default=True,
     help="sessions kept for the prefix cache (busy ones included)")
@opt("cache-kv", "cache_kv", default="2G", show_default=True, help="KV bytes the kept sessions may hold")
@opt("ub", "token_budget", type=click.IntRange(min=1), default=512, show_default=True,
     help="tokens per batched step (decoding slots one each, prompt chunks in the rest)")
@opt("prefill-stretch", "prefill_stretch", type=click.FloatRange(min=0), default=1.5, show_default=True,
     help="keep a step with prompt chunks beside decoding slots within this many decode steps' time (0: off)")
@placement_options(devices="cpu")
def serve(model_path, host, port, parallel, queue_size, alias, api_key, insecure, cache_sessions, cache_kv,
          token_budget, prefill_stretch, **flags) -> None:
    """Serve MODEL (default: the built-in SmolLM2-135M-Instruct) over OpenAI's chat and completions API."""
    from jitllm.default_model import MODEL_NAME
    from jitllm.runtime.placement import parse_placement
    from jitllm.server.engine import EngineSettings
    from jitllm.server.serve import ServeOptions, serve as run_server

    if model_path is not None:
        regular_file(model_path)
    if flags["placement"]:
        parse_placement(flags["placement"])  # (the grammar, before anything starts; the model checks the rest)
    if cache_sessions < parallel:
        raise click.UsageError(f"-cache-sessions {cache_sessions} is fewer than the -parallel {parallel} slots")
    model_id = alias or Path(model_path or MODEL_NAME).stem
    settings = EngineSettings(parallel, queue_size, cache_sessions, _size(cache_kv, "-cache-kv"), flags["verbose"],
                              token_budget, prefill_stretch)
    run_server(lambda log: load_model(model_path, flags, log=log),
               ServeOptions(model_id, host, port, api_key, insecure, settings))


def _client_options(func):
    func = _api_key_option(func)
    return opt("url", default=None, help="the server (default: $JITLLMD_URL or http://127.0.0.1:8080)")(func)


def _url(url: str | None) -> str:
    from jitllm.server.client import DEFAULT_URL

    return url or os.environ.get("JITLLMD_URL") or DEFAULT_URL


@click.command()
@_client_options
def models(url, api_key) -> None:
    """The models a running server serves."""
    from jitllm.server.client import models_table, request

    click.echo(models_table(request(_url(url), "/v1/models", api_key)))


@click.command()
@_client_options
def sessions(url, api_key) -> None:
    """A running server's sessions (its prefix cache): tokens, pages per device, last use."""
    from jitllm.server.client import request, sessions_table

    click.echo(sessions_table(request(_url(url), "/v1/sessions", api_key)))


@click.command()
@click.argument("moves", required=False, metavar="[SEL=TARGET,...]")
@_client_options
def place(moves, url, api_key) -> None:
    """Where a running server's blocks are; with SEL=TARGET,... move them (all or nothing, streams go on)."""
    from jitllm.server.client import moves_table, placement_table, request

    if moves is None:
        click.echo(placement_table(request(_url(url), "/v1/placement", api_key)))
    else:
        click.echo(moves_table(request(_url(url), "/v1/placement", api_key, {"moves": moves})))
