"""`prompt_token_ids`: a prompt's ids as Python ints with their bounds, in C passes where the values
are integers, one by one as `int` otherwise; the vocabulary check reads the bounds."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, strategies as st

from mstar.runtime.engine.runners.request_state import RequestState, prompt_token_ids, token_ids


@given(st.lists(st.integers(min_value=-2**63, max_value=2**63 - 1), max_size=300))
def test_integers_come_back_as_python_ints_with_their_bounds(values):
    ids, bounds = prompt_token_ids(values)
    assert ids == values and all(type(t) is int for t in ids)
    assert bounds == ((min(values), max(values)) if values else None)


def test_numpy_torch_and_bool_ids_become_python_ints():
    cases = ((np.arange(5, dtype=np.int32), [0, 1, 2, 3, 4]), (torch.arange(5), [0, 1, 2, 3, 4]),
             ([np.int64(0), 1, True, 3, np.int16(4)], [0, 1, 1, 3, 4]))
    for values, expected in cases:
        ids, bounds = prompt_token_ids(values)
        assert ids == expected and all(type(t) is int for t in ids) and bounds == (min(expected), max(expected))


def test_other_values_take_int_one_by_one_as_before():
    assert prompt_token_ids(["7", "12"]) == ([7, 12], (7, 12))
    assert prompt_token_ids([2.0, 5]) == ([2, 5], (2, 5))
    big = 2**70
    assert prompt_token_ids([1, big]) == ([1, big], (1, big))  # past 64 bits: found out of vocabulary later
    assert prompt_token_ids(b"\x01\x02") == ([1, 2], (1, 2))  # bytes are ids a byte, not raw 64-bit words
    assert token_ids([]) == [] and prompt_token_ids([]) == ([], None)


def test_request_state_keeps_the_bounds_for_the_vocabulary_check():
    state = RequestState.from_request("r", {"prompt_tokens": [5, -1, 9], "max_tokens": 1})
    assert state.prompt_tokens == [5, -1, 9] and state.prompt_bounds == (-1, 9)
