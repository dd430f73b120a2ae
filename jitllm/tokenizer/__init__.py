"""Tokenizers: built offline from GGUF metadata at convert time, run from the .jlm header at load time.

gguf_vocab builds a Hugging Face `tokenizers` tokenizer from a GGUF's vocabulary (gguf_metadata reads
it, and the tensor infos the converter maps, bpe_splits has the pre-tokenizer rules), runtime wraps it with the model's token settings,
model_file loads it from a .jlm or a GGUF, chat_template renders conversations like transformers,
stop_tokens picks the ids that end a turn.
"""

from .gguf_metadata import GgufContents, GgufTensorInfo, read_gguf, read_gguf_metadata
from .gguf_vocab import CONTROL, gguf_tokenizer, header_from_gguf
from .model_file import check_token_settings, load_tokenizer, model_tokenizer
from .runtime import StreamDecoder, Tokenizer
from .stop_tokens import stop_token_ids

__all__ = ["CONTROL", "GgufContents", "GgufTensorInfo", "StreamDecoder", "Tokenizer", "check_token_settings",
           "gguf_tokenizer", "header_from_gguf", "load_tokenizer", "model_tokenizer", "read_gguf", "read_gguf_metadata",
           "stop_token_ids"]
