"""Tokenizers: built offline from GGUF metadata at convert time, run from the .jlm header at load time.

gguf_vocab builds a Hugging Face `tokenizers` tokenizer from a GGUF's vocabulary (with bpe_splits'
pre-tokenizer rules), runtime wraps it with the model's token settings, chat_template renders
conversations like transformers, stop_tokens picks the ids that end a turn.
"""

from .gguf_vocab import CONTROL, USER_DEFINED, gguf_tokenizer, header_from_gguf
from .runtime import StreamDecoder, Tokenizer
from .stop_tokens import END_TOKENS, stop_token_ids

__all__ = ["CONTROL", "END_TOKENS", "USER_DEFINED", "StreamDecoder", "Tokenizer", "gguf_tokenizer",
           "header_from_gguf", "stop_token_ids"]
