"""A long stream's chunks each hold their items: `StreamBuffer.poll` sliced a chunk after `_take`
had dropped the stream's start (once the read position passed 4096 items), so that chunk came back
empty: every ~4,096 positions a window (Orpheus's SNAC: one window in 586) or a fixed chunk reached
its consumer with no items."""
from mstar.plan.schema import ChunkPolicyPlan
from mstar.runtime.conductor.streams import StreamBuffer


def _chunks(buf):
    out = []
    while (chunk := buf.poll()) is not None:
        out.append(chunk.items)
    return out


def test_every_window_of_a_long_stream_holds_its_items():
    buf = StreamBuffer(ChunkPolicyPlan(kind="window", size=28, stride=7))
    chunks = []
    for start in range(0, 20000, 100):
        buf.push(list(range(start, start + 100)))
        chunks += _chunks(buf)
    assert [c[0] for c in chunks] == list(range(0, 7 * len(chunks), 7))
    assert all(c == list(range(c[0], c[0] + 28)) for c in chunks)


def test_fixed_chunks_of_a_long_stream_carry_every_item_once():
    buf = StreamBuffer(ChunkPolicyPlan(kind="fixed", size=4))
    buf.push(list(range(5000)))
    buf.mark_producer_done()
    assert [item for chunk in _chunks(buf) for item in chunk] == list(range(5000))
