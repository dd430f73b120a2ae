"""A .jlm opened with its whole header checked, before anything compiles or a device is touched.

The checks are header arithmetic only (the weights are never read): the container (jitllm.core.jlm_validate:
regions and tensor entries inside the file), the config, weight types and tensors against each other
(jitllm.runtime.model_check), and the token settings with the vocabulary against the embedding
(jitllm.tokenizer.model_file). Nothing here imports TVM, so the CLI opens a model this way first and a bad
file is one line in a fraction of a second; `jitllm.model.load_with` starts from what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.ir.config import ModelConfig
from jitllm.tokenizer import Tokenizer, model_tokenizer

if TYPE_CHECKING:
    from jitllm.runtime.model_layout import ModelLayout


@dataclass(frozen=True)
class CheckedModel:
    file: JlmFile
    layout: ModelLayout
    tokenizer: Tokenizer


def open_checked(path: str | Path) -> CheckedModel:
    """The file, its layout and its tokenizer; the first problem found as one JitllmError line."""
    file = JlmFile(path)
    try:
        config = ModelConfig.from_json(file.header.get("config"))
        tokenizer = model_tokenizer(file.header, config.vocab)
    except JitllmError as e:
        raise JitllmError(f"{file.path}: {e}") from None
    # The block types import onnx (a second or two on a busy machine): after the checks that need none.
    from jitllm.runtime.model_layout import ModelLayout

    return CheckedModel(file, ModelLayout.from_file(file), tokenizer)
