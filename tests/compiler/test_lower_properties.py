"""Properties of the mixture table and the batch_pad lookup over random nodes (hypothesis)."""
from bisect import bisect_left

from hypothesis import given
from hypothesis import strategies as st

from mstar.compiler.lower_keys import batch_pad_table, lower_node_keys
from mstar.lang import ast
from mstar.compiler.walk_tree import WalkTree as WalkPlan

sizes = st.lists(st.integers(1, 128), min_size=1, max_size=8, unique=True)


@given(sizes=sizes, max_rows=st.integers(0, 200))
def test_batch_pad_is_smallest_size_at_least_b(sizes, max_rows):
    table = batch_pad_table(sizes, max_rows)
    ordered = sorted(sizes)
    assert len(table) == max(max_rows, ordered[-1]) + 1 and table[0] == 0
    for b in range(1, len(table)):
        i = bisect_left(ordered, b)
        assert table[b] == (ordered[i] if i < len(ordered) else 0)


@st.composite
def combined_nodes(draw):
    num_walks = draw(st.integers(2, 4))
    walks = [f"w{i}" for i in range(num_walks)]
    caps = {w: draw(st.integers(1, 64)) for w in walks}
    with_capture = {w: draw(st.booleans()) for w in walks}
    combine_cap = draw(st.one_of(st.none(), st.integers(1, 64)))
    here = draw(st.lists(st.sampled_from(walks), min_size=1, unique=True))
    node = ast.NodeDecl(
        name="N", engine="kv",
        caps=[ast.CapDecl(walk=w, value=caps[w]) for w in walks],
        captures=[ast.CaptureDecl(walk=w, family="batched", batch=[1, 2, 4]) for w in walks if with_capture[w]],
        combines=[ast.CombineDecl(name="mix", walks=walks, cap=combine_cap,
                                  capture=ast.CaptureDecl(family="packed", batch=[1, 8], tokens=[64]))],
    )
    return node, caps, combine_cap, [w for w in walks if w in here]


@given(combined_nodes())
def test_mixture_caps_follow_the_rule(case):
    node, caps, combine_cap, walks_here = case
    walk_plans = {w: WalkPlan(name=w, partition="P", nodes=["N"], body=[]) for w in caps}
    keys, walk_to_key = lower_node_keys(node, walks_here, walk_plans, {w: 1 for w in caps}, 256)
    assert set(walk_to_key) == set(walks_here)
    if len(walks_here) == 1:
        (key,) = keys
        assert key.name == f"N:{walks_here[0]}" and not key.is_combined
    for key in keys:
        assert [m.mask for m in key.mixtures] == list(range(1 << len(key.walks)))
        for m in key.mixtures[1:]:
            present = [w for i, w in enumerate(key.walks) if m.mask >> i & 1]
            assert m.walks == present
            if len(present) == 1:
                assert m.cap == caps[present[0]] and m.label == present[0]
                assert m.capture == (f"N:{present[0]}" if any(c.walk == present[0] for c in node.captures) else None)
            else:
                expected = combine_cap if combine_cap is not None else min(caps[w] for w in present)
                assert m.cap == expected and m.capture == "N:mix" and m.label is None
        for family in key.captures:
            users = [m.cap for m in key.mixtures if m.capture == family.name]
            assert len(family.batch_pad) >= max(users) + 1  # every legal step has an entry
