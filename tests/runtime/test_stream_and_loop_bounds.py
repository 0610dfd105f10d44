"""Behaviour a mutation audit found no test holding: stream keep ranges and covered items
after long streams drop their head (conductor/streams.py), and per-request loop count bounds
(conductor/loop_counts.py)."""
from types import SimpleNamespace

from mstar.plan.schema import ChunkPolicyPlan
from mstar.runtime.conductor.loop_counts import LoopCounts
from mstar.runtime.conductor.streams import StreamBuffer


def _drain(buf):
    chunks = []
    while (chunk := buf.poll()) is not None:
        if not chunk.items and not chunk.is_final:
            break
        chunks.append((chunk.items, chunk.is_final))
    return chunks


def test_keep_range_holds_both_of_its_ends():
    # docs/language.md: `keep LOW..HIGH` is inclusive (Orpheus's last audio id 156937 is a code)
    buf = StreamBuffer(ChunkPolicyPlan(kind="window", size=2, stride=2), keep=(100, 199))
    buf.push([99, 100, 199, 200])
    assert _drain(buf) == [([100, 199], False)]


def test_a_long_stream_whose_items_are_all_covered_ends_without_a_repeated_chunk():
    # 4100 items through window(4, stride=2): the last chunk [4096:4100] moves pos past 4096, which
    # drops the head; the two overlap items left are covered, so no final chunk repeats them
    buf = StreamBuffer(ChunkPolicyPlan(kind="window", size=4, stride=2))
    buf.push(list(range(4100)))
    _drain(buf)
    buf.mark_producer_done()
    assert not buf.has_chunk() and buf.is_exhausted
    assert _drain(buf) == []


def _plan(*loops):
    return SimpleNamespace(walks=[SimpleNamespace(name="w", loops=[
        SimpleNamespace(name=name, count_param="steps", max_iters=most) for name, most in loops])])


def test_a_count_read_by_two_loops_is_bounded_by_the_smaller_max():
    for loops in ([("a", 8), ("b", 4)], [("b", 4), ("a", 8)]):
        counts = LoopCounts(_plan(*loops))
        assert counts.problem({"steps": 4}) is None
        problem = counts.problem({"steps": 6})
        assert problem is not None and "outside 1..4" in problem and "w/b" in problem, problem
