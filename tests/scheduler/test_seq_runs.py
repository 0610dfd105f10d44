"""SeqRuns behaves like a plain list of increasing sequence numbers."""
from bisect import bisect_left

from hypothesis import given
from hypothesis import strategies as st

from mstar.runtime.scheduler.seq_runs import SeqRuns

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3), st.integers(0, 5)),  # gap, count
        st.tuples(st.just("drop"), st.integers(0, 6)),
        st.tuples(st.just("remove"), st.integers(0, 50)),
    ),
    max_size=40,
)


@given(OPS, st.integers(0, 60), st.integers(0, 10))
def test_seq_runs_match_a_list(ops, probe, start):
    runs, model, next_seq = SeqRuns(), [], 0
    for op in ops:
        if op[0] == "append":
            next_seq += op[1]
            runs.append(next_seq, op[2])
            model += range(next_seq, next_seq + op[2])
            next_seq += op[2]
        elif op[0] == "drop":
            count = min(op[1], len(model))
            runs.drop_front(count)
            del model[:count]
        elif model:
            del model[op[1] % len(model)]
            runs.reset(list(model))
        assert len(runs) == len(model)
        assert runs.to_list() == model
        assert [runs.seq_at(i) for i in range(len(model))] == model
        clipped = min(start, len(model))
        assert runs.index_at_or_after(probe, clipped) == max(bisect_left(model, probe), clipped)
