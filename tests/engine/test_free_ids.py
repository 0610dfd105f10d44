"""`FreeIds` (kv/free_ids.py) hands out ids in the order the list of every free id it replaced did,
and a huge pool costs nothing up front (2**31 host pages were a 17 GB list at start-up)."""
from hypothesis import given, strategies as st

from mstar.runtime.engine.kv.free_ids import FreeIds
from mstar.runtime.engine.kv.offload import Offload
from mstar.runtime.engine.kv.slots import SlotPool


@given(st.integers(0, 3), st.integers(0, 12), st.lists(st.booleans(), max_size=60))
def test_the_same_order_as_a_list_of_every_free_id(first, size, takes):
    free, model = FreeIds(first, first + size), list(range(first + size - 1, first - 1, -1))
    held: list[int] = []
    for is_take in takes:
        if is_take:
            taken = free.take()
            assert taken == (model.pop() if model else None)
            if taken is not None:
                held.append(taken)
        elif held:
            given_back = [held.pop(), *held[-1:]]
            del held[-1:]
            free.give_back(given_back)
            model.extend(given_back)
        assert len(free) == len(model)


def test_a_huge_pool_is_built_at_once():
    assert Offload(2**31 - 1).num_free_host_pages == 2**31 - 1
    slots = SlotPool("LLM", 2**40)
    assert slots.num_free_slots == 2**40 - 1 and slots.acquire("r") == 1  # slot 0 is the sink
