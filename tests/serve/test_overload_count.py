"""A 429's count of the requests in flight includes the room bodies of several choices reserved:
a full queue of reserved room said "0 requests in flight, the most this server queues (N)"."""
from __future__ import annotations

import json

from mstar.runtime.serve.api import LLM
from serve_harness import LLAMA, make_service, post_json, running


def test_a_429_counts_the_room_reserved_as_in_flight():
    llm = LLM(LLAMA, engine="sim", sim_pace=0, max_waiting=0)
    cap = llm.loop.max_in_flight
    llm.loop.reserve([f"held-{i}" for i in range(cap)])  # what bodies of n choices hold while they submit
    with running(make_service(llm)) as url:
        status, error = post_json(f"{url}/completions", json.dumps(
            {"model": "llama", "prompt": [1, 2, 3], "max_tokens": 2}).encode())
    assert status == 429
    assert error["message"] == f"{cap} requests in flight, the most this server queues ({cap}); retry later"
