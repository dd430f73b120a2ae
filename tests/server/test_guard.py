"""The guard in front of the routes, in process (no socket): the placement endpoint is closed on a
non-loopback address without an API key; with one, every route needs it; /health says the stage."""

from __future__ import annotations

from starlette.testclient import TestClient

from jitllm.server.app import AppSettings, build_app
from jitllm.server.engine import Engine, EngineSettings
from jitllm.server.metrics import Metrics


def app(**settings) -> TestClient:
    metrics = Metrics()
    engine = Engine(lambda log: None, EngineSettings(), metrics)  # (never started: the model is "starting")
    return TestClient(build_app(engine, AppSettings("m", **settings), metrics))


def test_placement_is_closed_off_loopback_without_a_key():
    insecure = app(loopback=False)
    for method in ("GET", "POST"):
        answer = insecure.request(method, "/v1/placement", json={"moves": "0=host"})
        assert answer.status_code == 403 and "placement" in answer.json()["error"]["message"]
    assert insecure.get("/v1/models").status_code == 200  # (the rest stays open, as -insecure asked)
    local = app(loopback=True)
    assert local.get("/v1/placement").status_code == 503  # open on loopback: the model is not loaded yet


def test_with_a_key_every_route_needs_it():
    keyed = app(loopback=False, api_key="k")
    assert keyed.get("/v1/placement").status_code == 401
    assert keyed.get("/v1/placement", headers={"Authorization": "Bearer k"}).status_code == 503
    health = keyed.get("/health", headers={"Authorization": "Bearer k"})
    assert health.status_code == 503 and health.json()["stage"] == "starting"
