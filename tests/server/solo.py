"""A session's greedy tokens run alone on the model's executor: what each server test's streams must
give whatever the engine does around them (batched steps, moves, chunked prompts)."""

from __future__ import annotations

import numpy as np


def alone(model, prompt: list[int], steps: int) -> list[int]:
    ex = model.executor
    session = ex.new_session()
    tokens = [int(np.argmax(ex.forward(session, prompt)))]
    while len(tokens) < steps:
        tokens.append(int(np.argmax(ex.forward(session, [tokens[-1]]))))
    ex.close_session(session)
    return tokens
