"""Chunk policies of stream buffers (reference notes 2.8)."""
from mstar.plan.schema import ChunkPolicyPlan
from mstar.runtime.conductor.streams import StreamBuffer


def drain(buf: StreamBuffer) -> list[tuple[list, bool]]:
    chunks = []
    while True:
        chunk = buf.poll()
        if chunk is None:
            return chunks
        chunks.append((chunk.items, chunk.is_final))


def window(size=28, stride=7):
    return StreamBuffer(ChunkPolicyPlan(kind="window", size=size, stride=stride))


def test_window_28_stride_7_slides_by_stride():
    buf = window()
    for token in range(27):
        buf.push([token])
    assert not buf.has_chunk() and buf.poll() is None
    buf.push([27])
    assert drain(buf) == [(list(range(28)), False)]
    buf.push(list(range(28, 42)))
    assert drain(buf) == [(list(range(7, 35)), False), (list(range(14, 42)), False)]


def test_window_final_partial_chunk_after_producer_done():
    buf = window()
    buf.push(list(range(38)))
    assert [items for items, _ in drain(buf)] == [list(range(28)), list(range(7, 35))]
    assert not buf.is_exhausted
    buf.mark_producer_done()
    assert drain(buf) == [(list(range(14, 38)), True)]
    assert buf.is_finished and buf.is_exhausted


def test_window_without_uncovered_items_finishes_without_an_empty_chunk():
    buf = window()
    buf.push(list(range(35)))
    assert len(drain(buf)) == 2
    buf.mark_producer_done()
    assert buf.is_exhausted
    assert drain(buf) == []


def test_short_stream_is_one_final_chunk():
    buf = window()
    buf.push(list(range(10)))
    buf.mark_producer_done()
    assert drain(buf) == [(list(range(10)), True)]


def test_left_context_25_25_overlaps_one_chunk_of_context():
    buf = StreamBuffer(ChunkPolicyPlan(kind="left_context", size=25, context=25))
    buf.push(list(range(24)))
    assert buf.poll() is None
    buf.push(list(range(24, 100)))
    chunks = drain(buf)
    assert chunks[0] == (list(range(25)), False)  # the first chunk has no context
    assert chunks[1] == (list(range(0, 50)), False)  # 25 context + 25 new
    assert chunks[2] == (list(range(25, 75)), False)
    assert chunks[3] == (list(range(50, 100)), False)
    buf.push(list(range(100, 110)))
    buf.mark_producer_done()
    assert drain(buf) == [(list(range(75, 110)), True)]  # final keeps its left context


def test_fixed_continue_after_done_keeps_sending_empty_chunks():
    buf = StreamBuffer(ChunkPolicyPlan(kind="fixed", size=1, is_continue_after_done=True))
    buf.push("a")
    buf.push("b")
    assert buf.poll().items == ["a"]
    buf.mark_producer_done()
    assert buf.poll().items == ["b"]
    for _ in range(3):
        chunk = buf.poll()
        assert chunk.items == [] and not chunk.is_final
    assert not buf.is_exhausted and buf.has_chunk()


def test_fixed_without_continue_flushes_a_final_partial_chunk():
    buf = StreamBuffer(ChunkPolicyPlan(kind="fixed", size=4))
    buf.push(list(range(10)))
    assert drain(buf) == [([0, 1, 2, 3], False), ([4, 5, 6, 7], False)]
    buf.mark_producer_done()
    assert drain(buf) == [([8, 9], True)]
    assert buf.is_exhausted


def test_non_list_values_are_single_items():
    buf = StreamBuffer(ChunkPolicyPlan(kind="fixed", size=2))
    buf.push({"hidden": 1})
    buf.push({"hidden": 2})
    assert buf.poll().items == [{"hidden": 1}, {"hidden": 2}]


def test_long_streams_drop_unreachable_items():
    buf = window()
    for start in range(0, 20000, 100):
        buf.push(list(range(start, start + 100)))
        drain(buf)
    assert buf.num_items < 5000
    buf.mark_producer_done()
    final = drain(buf)
    assert final and final[-1][1] and final[-1][0][-1] == 19999


def test_keep_range_drops_items_before_they_take_a_position():
    # Orpheus: only audio tokens enter the SNAC windows; a text token between them shifts nothing
    buf = StreamBuffer(ChunkPolicyPlan(kind="window", size=4, stride=2), keep=(100, 199))
    buf.push([100, 5, 101])
    buf.push(7)
    buf.push([102, 250, 103, 104, 105])
    assert drain(buf) == [([100, 101, 102, 103], False), ([102, 103, 104, 105], False)]
    buf.mark_producer_done()
    assert drain(buf) == []


def test_keep_range_applies_unless_the_producer_is_a_stand_in_that_cannot_reach_it():
    from pathlib import Path

    from mstar.plan.io import load_plan
    from mstar.runtime.conductor.streams import stream_keeps

    plan = load_plan(str(Path(__file__).resolve().parents[2] / "generated" / "orpheus.plan"))
    [stream] = [s for p in plan.partitions for s in p.streams]
    assert stream.producer_node == "LLM" and stream.keep == (128266, 156937)
    key = (next(p.name for p in plan.partitions if p.streams), stream.edge)
    assert stream_keeps(plan, {}) == {key: (128266, 156937)}  # the checkpoint's own vocabulary
    assert stream_keeps(plan, {"LLM": 512}) == {}  # tiny dims: ids below 512 only
    assert stream_keeps(plan, {"LLM": 130000}) == {key: (128266, 156937)}
