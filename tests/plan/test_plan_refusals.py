"""Hand-edited plans (content hash recomputed) that reached internal errors in `mstar run --engine
sim` (KeyError, DuplicateRowError, WalkStateError, UnknownPlacementError, or a hang) are refused
by load_plan with its one-line message naming the table and value: TP groups and call instances
against the workers (mstar/plan/rank_checks.py), the loops around each call (loop_nesting.py) and
chunk policies (stream_checks.py). tests/compiler/test_plan_references.py has the older cases."""
from __future__ import annotations

from pathlib import Path

import pytest

from mstar.cli.mstar import main as mstar_main
from mstar.cli.mstarc import main as mstarc_main
from mstar.plan.io import PlanError, load_plan
from mstar.plan.references import reference_problems
from plan_files import edited_plan as _edited, plan_walk as _walk, written_beside_its_sources

ROOT = Path(__file__).resolve().parents[2]


def _set_rank(worker: int, index: int, rank: int):
    def edit(data):
        data["workers"][worker]["tp_groups"][0]["ranks"][index] = rank
    return edit


def _no_tp_groups(data):
    for worker in data["workers"]:
        worker["tp_groups"] = []


def _decode_loop_not_entered(data):
    del _walk(data, "decode")["start"]["loops"][0]


def _instances(walk: str, instances):
    def edit(data):
        _walk(data, walk)["calls"][0]["instances"] = instances
    return edit


def _tp_for_decode_alone(data):
    """orpheus_tp2 as mstarc would write it if MW321 let a deployment put LLM's TP group on decode
    alone: each rank runs prefill on its own (the instances to match, so nothing else disagrees)."""
    for worker in data["workers"]:
        for group in worker["tp_groups"]:
            group["walks"] = ["decode"]
    _walk(data, "prefill")["calls"][0]["instances"] = [[0], [1]]


def _policy(partition: int, **fields):
    def edit(data):
        data["partitions"][partition]["streams"][0]["policy"].update(fields)
    return edit


def _tp_group(**fields):
    """Every worker's (one) TP group edited alike, so the groups still agree with each other."""
    def edit(data):
        for worker in data["workers"]:
            worker["tp_groups"][0].update(fields)
    return edit


def _foreign_tp_group(data):
    """Worker 0 also lists a group of rank 1 alone (one that rank 1 does not list)."""
    data["workers"][0]["tp_groups"].append(dict(data["workers"][0]["tp_groups"][0], ranks=[1], leader=1,
                                                tp_size=1))


def _stream_in_the_producers_partition(data):
    """orpheus' SNAC stream moved to the LLM partition, whose walks never call snac_decoder."""
    data["partitions"][0]["streams"], data["partitions"][1]["streams"] = data["partitions"][1]["streams"], []


# name -> (plan, edit, what the message says); each reached an internal error (or a hang) in a
# 2-request sim run before load_plan checked it. (The cases after the first block were added by
# the compiler mutation audit: each check they name passed every test with its condition removed.)
EDITS = {
    "TP group rank -1": ("orpheus_tp2", _set_rank(0, 0, -1),  # KeyError: -1
                         "worker 0: TP group of LLM with ranks [-1, 1] has rank -1, which the plan lacks"),
    "TP group rank past the world": ("orpheus_tp2", _set_rank(0, 1, 2),  # KeyError: 2
                                     "TP group of LLM with ranks [0, 2] has rank 2, which the plan lacks "
                                     "(its ranks are 0 to 1)"),
    "TP groups emptied": ("orpheus_tp2", _no_tp_groups,  # DuplicateRowError
                          "walk prefill: call 0 (LLM) runs on TP instance [0, 1], but worker 0 lists no TP "
                          "group for LLM/prefill"),
    "the leader's TP group removed": ("orpheus_tp2", lambda d: d["workers"][0].update(tp_groups=[]),
                                      "worker 1: TP group of LLM with ranks [0, 1] holds rank 0, which does not "
                                      "list this group"),
    "a follower's TP group names it leader": (  # SchedulerError: worker 1 leads key LLM:mixed
        "orpheus_tp2", lambda d: d["workers"][1]["tp_groups"][0].update(leader=1),
        "worker 1: TP group of LLM with ranks [0, 1] has leader 1, not its first rank"),
    "TP group of an unknown node": ("qwen3omni_thinker_tp2",
                                    lambda d: d["workers"][0]["tp_groups"][0].update(node="zz"),
                                    "TP group of zz with ranks [0, 1] names unknown node 'zz'"),
    "decode loop not entered (orpheus)": ("orpheus", _decode_loop_not_entered,  # WalkStateError
                                          "walk decode: its start (loops []) starts call 0 (LLM), which sits in "
                                          "loop 0 (decode_loop), without entering that loop"),
    "decode loop not entered (llama)": ("llama", _decode_loop_not_entered,
                                        "walk decode: its start (loops []) starts call 0 (LLM), which sits in "
                                        "loop 0 (decode_loop), without entering that loop"),
    "a transition into a loop's call": ("vjepa2_ac", lambda d: d["walks"][0]["calls"][1]["then"].update(loops=[]),
                                        "without entering that loop"),
    "instance on a rank that does not run the walk": ("orpheus", _instances("decode", [[1]]),  # UnknownPlacement
                                                      "walk decode: call 0 (LLM) runs on rank 1, whose worker "
                                                      "does not run LLM/decode"),
    "TP instance cut to one rank": ("orpheus_tp2", _instances("decode", [[0]]),  # DuplicateRowError
                                    "walk decode: call 0 (LLM) has instances [[0]], but its workers' placements "
                                    "and TP groups give [[0, 1]]"),
    # every request ended `stalled`: prefill wrote the KV on one rank, decode read it sharded over two
    "TP groups that cover decode alone": ("orpheus_tp2", _tp_for_decode_alone,
                                          "node LLM: its walks run at TP world sizes 1 (walk prefill) and 2 "
                                          "(walk decode); its KV cache cannot move between different TP world "
                                          "sizes"),
    "workers out of rank order": ("orpheus", lambda d: d["workers"].reverse(),
                                  "workers[0] is rank 1; the workers are ranks 0 to 1, in order"),
    "window stride -1": ("orpheus", _policy(1, stride=-1),  # the run hung
                         "partition SNAC: stream new_token: a window policy has stride -1"),
    "left_context that continues after done": ("qwen3_tts", _policy(1, is_continue_after_done=True),  # hung
                                               "stream codec_tokens: a left_context policy continues after done"),
    # every request spun for ever: SNAC's one walk re-runs per chunk, and the stream never ends
    "a fixed stream that continues after done into a one-walk partition": (
        "orpheus", _policy(1, kind="fixed", size=28, stride=None, is_continue_after_done=True),
        "partition SNAC: stream new_token continues after done into a partition whose one-walk route"),
    "TP group that repeats a rank": ("orpheus_tp2", _tp_group(ranks=[0, 0]),
                                     "worker 0: TP group of LLM with ranks [0, 0] repeats a rank"),
    "TP group of negative sizes": ("orpheus_tp2", _tp_group(tp_size=-1, sp_size=-2),
                                   "has 2 ranks for tp_size -1 x sp_size -2"),
    "TP group that does not hold its worker": ("orpheus_tp2", _foreign_tp_group,
                                               "worker 0: TP group of LLM with ranks [1] does not hold rank 0"),
    "TP group of a walk its ranks do not run": ("orpheus_tp2", _tp_group(walks=["decode", "prefill", "snac_chunk"]),
                                                "runs walk 'snac_chunk', which rank 0 does not run on LLM"),
    "window of size 0": ("orpheus", _policy(1, size=0), "partition SNAC: stream new_token has chunk size 0"),
    "fixed policy with a stride": ("orpheus", _policy(1, kind="fixed", stride=4),
                                   "stream new_token: a fixed policy has stride 4"),
    "left_context of negative context": ("qwen3_tts", _policy(1, context=-1),
                                         "stream codec_tokens: a left_context policy has context -1"),
    "stream that no walk of its partition takes": (
        "orpheus", _stream_in_the_producers_partition,
        "partition LLM: no walk of the partition calls snac_decoder on stream new_token"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_hand_edited_plans_are_refused_at_load(name, tmp_path):
    plan_name, edit, fragment = EDITS[name]
    plan = _edited(plan_name, edit)
    assert any(fragment in problem for problem in reference_problems(plan)), reference_problems(plan)
    path = written_beside_its_sources(plan, plan_name, tmp_path)
    with pytest.raises(PlanError, match="tables do not fit together") as error:
        load_plan(path)
    message = str(error.value)
    assert fragment in message and "so it was edited by hand. Recompile: mstarc compile" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["TP group rank -1", "TP groups emptied", "decode loop not entered (llama)",
                                  "instance on a rank that does not run the walk"])
def test_the_audits_plans_are_refused_by_the_commands(name, tmp_path, capsys):
    """The audit's reproductions: `mstar run --engine sim` and `mstarc explain` print the loader's
    refusal, not an internal error."""
    plan_name, edit, fragment = EDITS[name]
    path = written_beside_its_sources(_edited(plan_name, edit), plan_name, tmp_path)
    assert mstar_main(["run", "--plan", str(path), "--engine", "sim", "--requests", "2", "--no-progress"]) == 1
    assert mstarc_main(["explain", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count(fragment) == 2 and "internal error" not in err and "Traceback" not in err


def test_every_generated_plan_passes_the_checks():
    for path in sorted((ROOT / "generated").glob("*.plan")):
        assert reference_problems(load_plan(path, verify=False)) == [], path.name


def test_consistent_edits_the_runtime_runs_are_not_refused():
    """The checks follow mstarc's invariants, not its exact bytes where the runtime does not care:
    a TP group that lists its ranks leader first in another order, with the instances to match."""
    def leader_one(data):
        for worker in data["workers"]:
            worker["tp_groups"][0].update(ranks=[1, 0], leader=1)
        for walk in data["walks"]:
            for call in walk["calls"]:
                call["instances"] = [[1, 0] if i == [0, 1] else i for i in call["instances"]]
    assert reference_problems(_edited("orpheus_tp2", leader_one)) == []
