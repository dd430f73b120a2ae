"""How a byte-level BPE vocabulary splits text before its merges run, by GGUF `tokenizer.ggml.pre`.

The regexes are llama.cpp's (src/llama-vocab.cpp): each one splits the pieces the one before left, and
both its matches and the text between them become pieces, which is what a `tokenizers` Sequence of
`Split(..., behavior="isolated")` does. Tekken's is the one exception: llama.cpp only approximates its
upper/lower-case classes, so the original from the model's tokenizer.json is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from jitllm.core.errors import JitllmError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# tokenizer.json's (?i:'s|'t|'re|'ve|'m|'ll|'d) as llama.cpp spells it: no Unicode case folding ('ſ' is no s)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek's character classes, written as escapes: NFC-normalizing editors would silently rewrite
# some of their range ends (U+1F7D becomes U+03CE) and turn the ranges empty.
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"


@dataclass(frozen=True)
class SplitRule:
    """One llama.cpp pre-tokenizer type: its regexes, applied in order, and the flags that go with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    """A piece that is itself in the vocabulary becomes that token without merging (Llama 3 style)."""
    adds_bos: bool = False
    """llama.cpp prepends BOS when the GGUF has no tokenizer.ggml.add_bos_token."""


_LLAMA3_RULE = SplitRule((_LLAMA3,), ignore_merges=True, adds_bos=True)
_QWEN2_RULE = SplitRule((_QWEN2,))
_GPT2_RULE = SplitRule((_GPT2,))
_DIGITS_RULE = SplitRule((r"\p{N}", _GPT2))

RULES: dict[str, SplitRule] = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _LLAMA3_RULE),
    "dbrx": SplitRule((_LLAMA3,)),
    "smaug-bpe": SplitRule((_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open"),
                    _QWEN2_RULE),
    "qwen35": SplitRule((_QWEN35,)),
    **dict.fromkeys(("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais", "trillion",
                     "granite-docling"), _GPT2_RULE),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS_RULE),
    "falcon": SplitRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "deepseek-llm": SplitRule(("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCTUATION, r"\s+$", _DEEPSEEK_CJK,
                               r"\p{N}+")),
    "deepseek-coder": SplitRule(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")),
    "tekken": SplitRule((_TEKKEN,), ignore_merges=True, adds_bos=True),
}
"""tokenizer.ggml.pre -> its rule. Values llama.cpp maps to the same pre-tokenizer type share one."""


def split_rule(pre: str | None) -> SplitRule:
    """The rule for a `tokenizer.ggml.pre` value; an unknown or missing one is an error, never a guess."""
    if pre is None:
        raise JitllmError("GGUF metadata lacks tokenizer.ggml.pre (llama.cpp guesses a split rule for such "
                          "files and warns that quality degrades; reconvert the model with a current llama.cpp)")
    if pre not in RULES:
        raise JitllmError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
                          f"{', '.join(sorted(RULES))}")
    return RULES[pre]
