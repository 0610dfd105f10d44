"""Behaviour a mutation audit found no test holding: a request's draw stream differs per
node position (engine/sampling.py draw_stream), so two sampling nodes of one request with one
seed do not draw the same uniforms."""
import torch

from mstar.runtime.engine.sampling import draw_stream, uniforms


def test_draw_streams_differ_by_node_position_and_are_fixed_per_seed():
    for seed in (0, 1, 7, 2**40):
        streams = [draw_stream(seed, position) for position in range(4)]
        assert len(set(streams)) == 4
        assert streams == [draw_stream(seed, position) for position in range(4)]
    steps = torch.arange(8)
    first = uniforms(torch.full((8,), draw_stream(7, 0), dtype=torch.long), steps)
    second = uniforms(torch.full((8,), draw_stream(7, 1), dtype=torch.long), steps)
    assert not torch.equal(first, second)
