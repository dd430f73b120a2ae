"""Peer access between CUDA cards (devices/cuda.enable_peer_access) against a stand-in driver: every
ordered pair that can reach each other is enabled from the first card's context, an already-enabled
pair counts, a pair without a direct path is skipped, and the caller's context is current again."""

from __future__ import annotations

import pytest

from jitllm.runtime.backends import cuda_driver
from jitllm.runtime.backends.cuda import CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, enable_peer_access


class FakeDriver:
    def __init__(self, no_path: set[int], already: set[tuple[int, int]]) -> None:
        self.no_path, self.already = no_path, already
        self.current = 999
        self.enabled: list[tuple[int, int]] = []

    def cuDeviceGet(self, dev, ordinal) -> int:
        dev._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev) -> int:
        ctx._obj.value = 100 + dev.value
        return 0

    def cuCtxGetCurrent(self, ctx) -> int:
        ctx._obj.value = self.current
        return 0

    def cuCtxSetCurrent(self, ctx) -> int:
        self.current = ctx.value
        return 0

    def cuDeviceCanAccessPeer(self, can, a, b) -> int:
        can._obj.value = int(a.value not in self.no_path and b.value not in self.no_path)
        return 0

    def cuCtxEnablePeerAccess(self, peer, flags) -> int:
        pair = (self.current - 100, peer.value - 100)
        if pair in self.already:
            return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        self.enabled.append(pair)
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver(no_path={2}, already={(0, 1)})
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    return fake


def test_pairs_with_a_direct_path_are_enabled_both_ways(driver):
    assert enable_peer_access([0, 1, 2]) == [(0, 1), (1, 0)]
    assert driver.enabled == [(1, 0)]  # (0, 1) was on already; card 2 has no direct path
    assert driver.current == 999


def test_one_card_needs_nothing(driver):
    assert enable_peer_access([0]) == []
    assert driver.enabled == []
