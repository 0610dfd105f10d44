"""Where a step lands among a mixture's capture families (plan/buckets.pick_smallest, the scheduler's
and the GPU bench's rule): the smallest (tokens, padded batch) of the families of the step's guidance
mode or "any", the first listed on a tie. tests/runtime/test_capture_buckets.py runs the rule through
the schedulers on a compiled plan; these cases are the ties and modes it has none of."""
from mstar.plan.buckets import batch_pad_table, pick_smallest, serves
from mstar.plan.schema import CaptureFamily


def _batched(name: str, batch: list[int], tokens_per_row: int = 1, guidance: str = "any") -> CaptureFamily:
    return CaptureFamily(name=name, kind="batched", batch_sizes=batch, tokens_per_row=tokens_per_row,
                         batch_pad=batch_pad_table(batch, max(batch)), num_graphs=len(batch), memory_bytes=0,
                         guidance=guidance)


def test_a_family_of_either_mode_serves_guided_and_unguided_steps():
    family = _batched("any", [1, 2])
    assert serves(family, is_guided=True) and serves(family, is_guided=False)
    assert pick_smallest((family,), 1, [1], is_guided=True).capture == "any"
    guided = _batched("guided", [1, 2], guidance="guided")
    assert pick_smallest((guided,), 1, [1], is_guided=False).capture is None


def test_equal_tokens_are_decided_by_the_smaller_padded_batch():
    """Two one-token rows: batch sizes [1, 4] of one token a row pad them to 4 rows (4 tokens);
    batch size [2] of two tokens a row holds them in 2 rows (also 4 tokens), the smaller key."""
    one_a_row = _batched("one", [1, 4], tokens_per_row=1)
    two_a_row = _batched("two", [2], tokens_per_row=2)
    pick = pick_smallest((one_a_row, two_a_row), 2, [1, 1])
    assert (pick.capture, pick.padded_batch) == ("two", 2)


def test_on_an_exact_tie_the_first_listed_family_wins():
    first, second = _batched("first", [1, 2]), _batched("second", [2, 4])
    assert pick_smallest((first, second), 2, [1, 1]).capture == "first"
    assert pick_smallest((second, first), 2, [1, 1]).capture == "second"
