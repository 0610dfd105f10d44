"""Rank start-up checks (serve/ranks/launch.py): every rank runs rank 0's plan with rank 0's engine
options, checked before any group or model is built, and a spawned rank that cannot load the plan
says why through the store instead of a traceback."""
from __future__ import annotations

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.serve.ranks.channel import Message
from mstar.runtime.serve.ranks.launch import LaunchError, RankProcesses, load_or_tell
from mstar.runtime.serve.ranks.worker import RankOptions
from runtime_plans import ROOT

PLAN = ROOT / "generated" / "orpheus_tp2.plan"


class _Channel:
    def __init__(self, message: Message):
        self.message = message

    def recv(self, src, timeout_s=None, what="answering"):
        return self.message


def _hello(plan, options: RankOptions) -> Message:
    return Message("hello", {"plan": plan.header.content_sha256, "options": options.shared()})


def test_a_rank_with_other_engine_options_is_refused_naming_them():
    """torchrun starts each rank with its own command line: a rank with another --seed built its TP
    shard from other weights (other tokens, exit 0), another --kv-pages held other rows and the
    ranks' collectives aborted."""
    plan = load_plan(PLAN)
    ours = RankOptions(seed=0, weights=["/a/ckpt"], timeout_s=8.0, device="cpu")
    launch = RankProcesses(str(PLAN), plan, ours, is_torchrun=True)
    launch._await_hello(_Channel(_hello(plan, RankOptions(seed=0, weights=["/b/ckpt"], timeout_s=30.0))), 1)
    with pytest.raises(LaunchError, match=r"rank 1 runs with other engine options than rank 0 \(seed 1 against 0; "
                                          r"kv_pages 8 against None\)"):
        launch._await_hello(_Channel(_hello(plan, RankOptions(seed=1, kv_pages=8, weights=["/a/ckpt"]))), 1)
    # which nodes load a checkpoint must agree (a node of random weights on one rank), not from where
    with pytest.raises(LaunchError, match=r"weights \['Talker'\] against \['\*'\]"):
        launch._await_hello(_Channel(_hello(plan, RankOptions(weights=["Talker=/y"]))), 1)
    other = Message("hello", {"plan": "0" * 64, "options": ours.shared()})
    with pytest.raises(LaunchError, match="rank 1 loaded another plan than rank 0"):
        launch._await_hello(_Channel(other), 1)
    with pytest.raises(LaunchError, match="rank 2 cannot start its engine: out of memory"):
        launch._await_hello(_Channel(Message("fatal", {"message": "cannot start its engine: out of memory"})), 2)


def test_a_spawned_rank_that_cannot_load_the_plan_tells_rank_0_why(tmp_path):
    """The plan edited between rank 0's load and the child's (a recompile while the run starts):
    before, the child printed a traceback and rank 0 failed with an internal error (a TP plan) or
    "exited with code 1" (else)."""
    edited = tmp_path / "edited.plan"
    edited.write_text(PLAN.read_text().replace('"num_pages": 16384', '"num_pages": 16000', 1))
    told: dict[str, str] = {}

    class _Store:
        def set(self, key, value):
            told[key] = value

    with pytest.raises(SystemExit) as stopped:
        load_or_tell(str(edited), 1, _Store())
    assert stopped.value.code == 1
    assert told["mstar/fatal/1"].startswith("cannot load the plan: plan ") and "edited after it was compiled" in told[
        "mstar/fatal/1"]
    assert load_or_tell(str(PLAN), 1, _Store()).header.content_sha256 == load_plan(PLAN).header.content_sha256
