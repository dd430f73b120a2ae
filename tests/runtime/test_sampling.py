"""The sampler on hand-made logits: greedy, seeded draws, min-p and OpenAI's presence/frequency penalties, and
the parameters it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from jitllm.core.errors import JitllmError
from jitllm.runtime.sampling import Sampler, SamplingParams

LOGITS = np.array([3.0, 2.9, 0.0, -1.0, 2.0], np.float32)


def draws(params: SamplingParams, count: int = 200) -> list[int]:
    sampler = Sampler(params)
    return [sampler(LOGITS) for _ in range(count)]


def test_greedy_picks_the_first_largest_logit_and_lets_the_device_pick_it():
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert sampler.greedy and sampler(np.array([1.0, 5.0, 5.0], np.float32)) == 1


def test_seeded_draws_repeat_and_differ_between_seeds():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7)
    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=8))
    assert set(draws(params)) >= {0, 1, 4}  # the whole vocabulary is in play


def test_min_p_drops_the_tokens_far_below_the_likeliest():
    # p(4) / p(0) = e^-1 ~ 0.37, p(2) / p(0) = e^-3: min_p 0.3 keeps tokens 0, 1 and 4 only
    assert set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=1, min_p=0.3))) == {0, 1, 4}


def test_penalties_lower_the_tokens_already_picked():
    """Presence: once picked, a token loses the penalty; frequency: once per pick. Greedy picks then move on,
    so the device may not pick (the penalized logits are the host's)."""
    presence = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5))
    assert not presence.greedy
    assert [presence(LOGITS) for _ in range(4)] == [0, 1, 0, 0]  # 2.5 > 2.4 however often 0 was picked
    frequency = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.6))
    assert [frequency(LOGITS) for _ in range(5)] == [0, 1, 0, 1, 4]  # 3 - 1.2 < 2.9 - 0.6, then both < 2.0


def test_any_integer_seeds_and_tiny_temperatures_pick_the_likeliest():
    """A negative seed (what the server may be sent) is a reproducible seed like any other; a temperature so
    small that float32 would divide by zero (1e-320) samples in float64 and picks the likeliest token."""
    negative = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=-3)
    assert draws(negative) == draws(negative) != draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3))
    assert set(draws(SamplingParams(temperature=1e-320, top_k=0, top_p=1.0, seed=1), 20)) == {0}


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("temperature", -1.0), ("top_p", float("nan")), ("top_p", 1.5),
                                          ("min_p", float("nan")), ("presence_penalty", float("nan"))])
def test_parameters_that_cannot_sample_are_refused_in_one_line(field, value):
    with pytest.raises(JitllmError, match=f"sampling {field} .* out of range"):
        SamplingParams(**{field: value})
