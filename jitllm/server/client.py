"""The client verbs (`jitllmd models | sessions | place`): a running server's JSON, printed as tables."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from jitllm.core.errors import JitllmError

DEFAULT_URL = "http://127.0.0.1:8080"


def request(url: str, path: str, api_key: str | None = None, body: dict | None = None) -> dict:
    """GET (or, with a body, POST) `path` of the server at `url`; its error message as a JitllmError."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + path, data, headers), timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise JitllmError(f"{url}: {message} (HTTP {e.code})") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise JitllmError(f"cannot reach the server at {url}: {getattr(reason, 'strerror', None) or reason}") from None
    except ValueError as e:
        raise JitllmError(f"{url}: the answer is not JSON ({e})") from None


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in [header, *rows])


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def models_table(answer: dict) -> str:
    return table(["MODEL", "CONTEXT", "OWNED BY"], [[m["id"], str(m.get("context_length", "-")), m["owned_by"]]
                                                   for m in answer["data"]])


def sessions_table(answer: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [[str(s["id"]), s["state"], str(s["tokens"]),
             ", ".join(f"{device} {pages}" for device, pages in s["pages"].items()) or "-", mib(s["kv_bytes"]),
             f"{max(0.0, now - s['last_used']):.0f}s ago"] for s in answer["data"]]
    return table(["SESSION", "STATE", "TOKENS", "PAGES", "KV", "LAST USE"], rows)


def placement_table(answer: dict) -> str:
    units = table(["UNIT", "DEVICE", "PLANNED", "PINNED", "WEIGHTS"],
                  [[u["unit"], u["device"], u["planned"], "yes" if u["pinned"] else "", mib(u["bytes"])]
                   for u in answer["units"]])
    devices = table(["DEVICE", "WEIGHTS USED", "BUDGET", "KV", "KV BUDGET"],
                    [[d["name"], mib(d["used_bytes"]), mib(d["budget_bytes"]), mib(d["kv_bytes"]),
                      mib(d["kv_budget_bytes"])] for d in answer["devices"]])
    return units + "\n\n" + devices


def moves_table(answer: dict) -> str:
    if not answer["moves"]:
        return "nothing to move: every unit named is already there"
    return table(["UNIT", "FROM", "TO", "WEIGHTS", "KV", "MS"],
                 [[m["unit"], m["from"], m["to"], mib(m["weight_bytes"]), mib(m["kv_bytes"] + m["state_bytes"]),
                   f"{m['ms']:.2f}"] for m in answer["moves"]])
