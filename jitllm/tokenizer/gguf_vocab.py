"""A `tokenizers` tokenizer built offline from a GGUF's vocabulary metadata, tokenizing as llama.cpp does.

Two vocabulary types are built: "gpt2" (byte-level BPE; text is split first by the rule its
tokenizer.ggml.pre names, bpe_splits.py) and "llama" (SentencePiece: BPE over characters whose merges
go by the scores of the tokens they make, unknown characters as byte tokens, and llama.cpp's space
handling). Any other type is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from jitllm.core.errors import JitllmError, shown

from .bpe_splits import split_rule
from .stop_tokens import stop_token_ids

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # GGUF tokenizer.ggml.token_type values
SPACE = "\u2581"  # SentencePiece's visible space


def gguf_tokenizer(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The tokenizer a GGUF's metadata (values by key) describes."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in _BUILDERS:
        raise JitllmError(f"tokenizer model {model!r} (tokenizer.ggml.model) is not supported; supported: "
                          "'gpt2' (byte-level BPE), 'llama' (SentencePiece)")
    tokens = list(_required(metadata, "tokenizer.ggml.tokens"))
    try:
        tok = _BUILDERS[model](metadata, tokens)
    except JitllmError:
        raise
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises bare Exception)
        raise JitllmError(f"the GGUF vocabulary cannot be built: {e}") from None
    types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    # Control (and unknown) tokens are special: matched in a text only when asked to (llama.cpp's
    # parse_special). User-defined ones are matched always, as llama.cpp does.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


def token_settings(metadata: Mapping[str, Any], tok: tokenizers.Tokenizer) -> dict[str, Any]:
    """The .jlm header's token fields besides the tokenizer itself: chat template, BOS/EOS, stop ids, add_bos."""
    eos = _token_id(metadata, "tokenizer.ggml.eos_token_id")
    bos = _token_id(metadata, "tokenizer.ggml.bos_token_id") if "tokenizer.ggml.bos_token_id" in metadata else None
    ends = [_token_id(metadata, k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata]
    # Without the key, llama.cpp's default: SentencePiece and Llama-3-style vocabularies start with BOS.
    model, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    adds_bos = model == "llama" or split_rule(pre).adds_bos
    return {"chat_template": metadata.get("tokenizer.chat_template"),
            "bos_token_id": bos, "eos_token_id": eos,
            "stop_token_ids": stop_token_ids(tok, [eos, *ends]),
            "add_bos": bool(metadata.get("tokenizer.ggml.add_bos_token", adds_bos))}


def header_from_gguf(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer part of a .jlm header for a GGUF (see docs/model-format.md)."""
    tok = gguf_tokenizer(metadata)
    return {"tokenizer": tok.to_str(), **token_settings(metadata, tok)}


def _token_id(metadata: Mapping[str, Any], key: str) -> int:
    value = _required(metadata, key)
    if type(value) is not int:
        raise JitllmError(f"{key} must be a token id (got {shown(value)})")
    return value


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if metadata.get(key) is None:
        raise JitllmError(f"GGUF metadata lacks {key}")
    return metadata[key]


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    rule = split_rule(metadata.get("tokenizer.ggml.pre"))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [_merge_pair(m, tokens, vocab) for m in _required(metadata, "tokenizer.ggml.merges")]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=rule.ignore_merges))
    del vocab, merges  # (tens of thousands of Python objects, not held while the caller goes on)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge_pair(merge: str, tokens: list[str], vocab: dict[str, int]) -> tuple[str, str]:
    """A GGUF merge "left right" as a pair of the vocabulary's own string objects where the sides are
    tokens (the pairs then cost a tuple each, not two more strings: a 50k-merge vocabulary builds in
    ~6 MB less)."""
    left, space, right = merge.partition(" ")
    if not space:
        raise JitllmError(f"tokenizer.ggml.merges: {shown(merge)} is not two tokens separated by a space")
    i, j = vocab.get(left), vocab.get(right)
    return (left if i is None else tokens[i], right if j is None else tokens[j])


def _sentencepiece(metadata: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = int(metadata.get("tokenizer.ggml.unknown_token_id", 0))
    tok = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=_merges_by_score(tokens, _required(metadata, "tokenizer.ggml.scores"), vocab),
        unk_token=tokens[unk] if 0 <= unk < len(tokens) else None, fuse_unk=True, byte_fallback=True))
    # llama.cpp puts a space before each run of text that starts the input or follows a matched special
    # or user-defined token (a normalizer runs on each such run), then writes every space as U+2581;
    # decoding drops that first space again.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if prefix else []) + [normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_by_score(tokens: list[str], scores: Sequence[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scored token first. llama.cpp's SentencePiece merges
    the adjacent pair that makes the highest-scored token, which BPE with these merge ranks does too."""
    merges = {(-score, vocab[left], vocab[right], left, right)
              for token, score in zip(tokens, scores) for k in range(1, len(token))
              if (left := token[:k]) in vocab and (right := token[k:]) in vocab}
    return [(left, right) for *_, left, right in sorted(merges)]


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece}
