"""`penalties.TokenArrays`: a request's growing token lists as int64 arrays kept between steps (the
GPU fast path's penalties read them a step), equal to the lists whatever they grew by."""
import numpy as np
from hypothesis import given, strategies as st

from mstar.runtime.engine.gpu.penalties import TokenArrays


@given(st.lists(st.lists(st.integers(0, 2**40), max_size=40), max_size=12))
def test_the_arrays_follow_growing_lists(growths):
    arrays, history, sampled = TokenArrays(), [], []
    for added in growths:
        history.extend(added)
        sampled.extend(added[:1])
        for key, tokens in ((("LLM", "history"), history), (("LLM", "sampled"), sampled)):
            got = arrays.of(key, tokens)
            assert got.dtype == np.int64 and got.tolist() == tokens


def test_a_list_that_shrank_is_read_again_whole():
    arrays = TokenArrays()
    assert arrays.of(("LLM", "history"), [1, 2, 3]).tolist() == [1, 2, 3]
    assert arrays.of(("LLM", "history"), [7]).tolist() == [7]  # (another request's list under the key)
    assert arrays.of(("LLM", "history"), [7, 8]).tolist() == [7, 8]
