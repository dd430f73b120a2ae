"""Running `jitllmd` in tests: a real `serve` process per test module, on 127.0.0.1 and a port it picks itself,
stopped by SIGTERM; and the verbs run to their end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

JITLLMD = [sys.executable, "-c", "from jitllm.cli import jitllmd; jitllmd()"]
START_TIMEOUT = 300  # (a cold compile cache compiles the tiny model's kinds first)


def jitllmd(*args: str, cache: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """A jitllmd verb run to its end."""
    return subprocess.run([*JITLLMD, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, JITLLM_CACHE_DIR=str(cache), **(env or {})))


@dataclass
class Served:
    """A running server: its URL, its stderr so far, and the /health answers seen while it started."""

    process: subprocess.Popen
    url: str = ""
    stderr: list[str] = field(default_factory=list)
    health: list[tuple[int, dict]] = field(default_factory=list)

    def stop(self) -> int:
        """SIGTERM, and the exit code (the process must end within a minute)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


def start(model: Path, cache: Path, *args: str, env: dict | None = None, api_key: str | None = None) -> Served:
    """Start `jitllmd serve MODEL -port 0 ARGS`, read its URL, and poll /health until it is ready."""
    process = subprocess.Popen([*JITLLMD, "serve", str(model), "-port", "0", *args], stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, JITLLM_CACHE_DIR=str(cache), **(env or {})))
    served = Served(process)
    found = threading.Event()

    def drain() -> None:
        for line in process.stderr:
            served.stderr.append(line)
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if match and not served.url:
                served.url = match.group(1)
                found.set()
        found.set()

    threading.Thread(target=drain, daemon=True).start()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + START_TIMEOUT
    if not found.wait(60) or not served.url:
        served.stop()
        pytest.fail("jitllmd did not start: " + "".join(served.stderr))
    while time.monotonic() < deadline and process.poll() is None:
        try:
            answer = httpx.get(served.url + "/health", headers=headers, timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        served.health.append((answer.status_code, answer.json()))
        if answer.status_code == 200:
            return served
        time.sleep(0.05)
    served.stop()
    pytest.fail("jitllmd did not become ready: " + "".join(served.stderr))
