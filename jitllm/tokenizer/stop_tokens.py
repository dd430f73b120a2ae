"""Which token ids end a turn: the model's EOS ids and the end-of-turn specials its vocabulary has."""

from __future__ import annotations

import tokenizers

END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
              "<end_of_turn>")
"""Special tokens that end a turn wherever a vocabulary has them (llama.cpp's end-of-generation list)."""


def stop_token_ids(tok: tokenizers.Tokenizer, eos_ids: list[int]) -> list[int]:
    """The EOS ids followed by every special end-of-turn token the vocabulary has, without repeats."""
    special = {added.content: i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    out: list[int] = []
    for i in [*eos_ids, *(special[t] for t in END_TOKENS if t in special)]:
        if i not in out:
            out.append(i)
    return out
