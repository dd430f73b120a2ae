"""llama.cpp's tokenizer test data, from the llama-cpp-python 0.3.36 sdist on PyPI.

Only vendor/llama.cpp/models/ggml-vocab-* (vocabulary-only GGUFs, with .inp texts and the .out ids
that the models' own Hugging Face tokenizers gave) and models/templates/*.jinja (real chat templates)
are kept; the 76 MB sdist itself is deleted after extraction.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INDEX = "https://pypi.org/simple/llama-cpp-python/"
_MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
SEPARATOR = "\n__ggml_vocab_test__\n"


def fetch_models(dest: Path) -> None:
    """Fill `dest` with the sdist's models/ggml-vocab-* and models/templates/* (whole, or not at all)."""
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    url = next(f["url"] for f in files if f["filename"] == SDIST)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        sdist = Path(tmp) / SDIST
        with urllib.request.urlopen(url, timeout=60) as r, open(sdist, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        if hashlib.sha256(sdist.read_bytes()).hexdigest() != SHA256:
            raise ValueError(f"{SDIST} does not have the expected sha256")
        out = Path(tmp) / "models"
        (out / "templates").mkdir(parents=True)
        with tarfile.open(sdist, "r|gz") as tar:
            for member in tar:
                name = member.name.removeprefix(_MODELS)
                wanted = name.startswith("ggml-vocab-") or (name.startswith("templates/") and name.count("/") == 1)
                if member.isfile() and name != member.name and wanted:
                    (out / name).write_bytes(tar.extractfile(member).read())
        out.rename(dest)


def vocab_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of a vocab file's .inp/.out: each text is followed by SEPARATOR, and the .out has
    one line of space-separated ids per text (llama.cpp's tests/test-tokenizer-0.cpp reads them so)."""
    texts = Path(f"{gguf}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    assert texts[-1] == "", "the .inp ends with a separator"
    lines = Path(f"{gguf}.out").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "", "the .out ends with a newline"
    assert len(texts) == len(lines)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts[:-1], lines[:-1])]
