"""Shared fixtures: one compile cache for the whole session so each block kind compiles once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    shared = os.environ.get("JITLLM_TEST_CACHE")
    return Path(shared) if shared else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from jitllm.random_model import write_random_model

    path = tmp_path_factory.mktemp("models") / "tiny.jlm"
    write_random_model(path, "tiny", "q4_1", seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory) -> Path:
    """4 blocks: llama, gla, llama, gla (random weights)."""
    from jitllm.random_model import write_random_model

    path = tmp_path_factory.mktemp("models") / "tiny-hybrid.jlm"
    write_random_model(path, "tiny-hybrid", "q4_1", seed=1)
    return path
