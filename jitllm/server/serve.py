"""`jitllmd serve`: the socket, the engine thread and uvicorn, started and stopped together.

The socket is bound first (a port in use is one line, port 0 picks a free one); HTTP answers at once while the
engine thread loads the model (/health says 503 and the stage until then). SIGTERM (or ^C) stops accepting
connections, fails the queued jobs, lets the streams in the slots finish for up to SHUTDOWN_GRACE seconds
(then cancels them), stops the engine and returns: the process exits 0."""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Callable

import uvicorn

from jitllm.core.errors import JitllmError
from jitllm.server.app import AppSettings, build_app
from jitllm.server.engine import Engine, EngineSettings
from jitllm.server.metrics import Metrics

SHUTDOWN_GRACE = 10.0


@dataclass(frozen=True)
class ServeOptions:
    model_id: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    insecure: bool = False
    """Listen on a non-loopback address without an API key (the placement endpoint stays closed there)."""
    engine: EngineSettings = EngineSettings()


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def bind(host: str, port: int, api_key: str | None, insecure: bool) -> tuple[socket.socket, bool]:
    """A socket bound to host:port, and whether its address is a loopback one. A non-loopback address needs an
    API key or `insecure` (refused before anything is bound); JitllmError when it cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise JitllmError(f"-host {host}: {e.strerror}") from None
    loopback = is_loopback(address[0])
    if not loopback and not api_key and not insecure:
        raise JitllmError(f"-host {host} is not a loopback address: give -api-key KEY (or -insecure to serve "
                          "without one)")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise JitllmError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock, loopback


def serve(load: Callable[[Callable[[str], None]], object], options: ServeOptions) -> None:
    """Serve the model `load(log)` opens until SIGTERM or ^C; JitllmError when it cannot start or load."""
    sock, loopback = bind(options.host, options.port, options.api_key, options.insecure)
    metrics = Metrics()
    engine = Engine(load, options.engine, metrics)
    app = build_app(engine, AppSettings(options.model_id, options.api_key, loopback), metrics)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE)
    server = _Uvicorn(config, engine)
    failures: list[str] = []

    def failed(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    engine.on_failure = failed
    for sig in (signal.SIGTERM, signal.SIGINT):  # (uvicorn restores these and raises the signal again after
        signal.signal(sig, server.handle_exit)  # it stops: handled here, the process then exits 0)
    engine.start()
    host, port = sock.getsockname()[:2]
    print(f"jitllmd: serving {options.model_id} on http://{_url_host(host)}:{port}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
    if failures:
        raise JitllmError(failures[0])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling the engine to stop admitting work when a signal asks it to exit."""

    def __init__(self, config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame) -> None:
        self.engine.stop_admitting()
        super().handle_exit(sig, frame)
