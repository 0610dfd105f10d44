"""The plan-loading defenses (mstar/plan/io.py, references.py, rank_checks.py, loop_nesting.py,
stream_checks.py) held against the plan-check mutation audit: the cases here fail on the mutants
(a condition dropped, a bound moved by one, a check skipped) that passed every other plan test,
plus the accepted edits at the edges of the same checks.

A hand-edited plan (content hash recomputed, so only the table checks can catch it) is refused at
load with the problem named; a consistent edit mstarc could write is still accepted; and the
loader's file checks (int64 bounds, glue names, per-input size limits, the plan's own size limit)
hold at their edges. tests/plan/test_plan_refusals.py and tests/compiler/test_plan_references.py
have the older cases."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mstar.compiler.lower_tables import lower_walk_tables
from mstar.compiler.walk_tree import TreeCall, TreeEdge, TreeLoop, TreeParallel, WalkTree
from mstar.files import MAX_DEPLOYMENT_BYTES, MAX_GLUE_BYTES, MAX_PLAN_BYTES, MAX_SPEC_BYTES
from mstar.plan.io import PlanError, content_hash, dump_plan, load_plan
from mstar.plan.loop_nesting import loop_nesting_problems
from mstar.plan.references import reference_problems
from mstar.plan.schema import NodePlan, PartitionPlan, Plan, StagePlan, WalkPlan
from plan_files import (
    edited_plan as _edited, plan_key as _key, plan_node as _node, plan_walk as _walk, written_beside_its_sources,
)

ROOT = Path(__file__).resolve().parents[2]


def _written(plan: Plan, name: str, tmp_path: Path) -> Path:
    """The plan alone under tmp_path (its glue name is mstarc's; load it with verify=False)."""
    path = tmp_path / f"{name}.plan"
    path.write_text(dump_plan(plan))
    return path


def _family(key, name):
    return next(c for c in key["captures"] if c["name"] == name)


def _loop_back(data, walk="decode"):
    return next(e for e in _walk(data, walk)["calls"][0]["edges"] if e["action"] == "loop_back")


def _loop_output(data, walk="image_gen"):
    return next(e for e in _walk(data, walk)["calls"][0]["edges"] if e["action"] == "loop_output")


def _stream_edge(data, walk="prefill"):
    return next(e for e in _walk(data, walk)["calls"][0]["edges"] if e["dest_kind"] == "stream")


def _exit(data, walk="image_gen"):
    return _walk(data, walk)["loops"][0]["exits"][0]


def _loop(data, walk="decode"):
    return _walk(data, walk)["loops"][0]


def _then(walk: str, call: int, **then):
    def edit(data):
        _walk(data, walk)["calls"][call]["then"] = {"kind": "start", **then}
    return edit


def _update(get, **fields):
    """An edit that updates the dict `get(data)` returns with `fields`."""
    def edit(data):
        get(data).update(fields)
    return edit


def _policy(partition: int, **fields):
    return _update(lambda d: d["partitions"][partition]["streams"][0]["policy"], **fields)


def _tp_group(**fields):
    """Every worker's (one) TP group edited alike, so the groups still agree with each other."""
    def edit(data):
        for worker in data["workers"]:
            worker["tp_groups"][0].update(fields)
    return edit


def _duplicate(table: str, index: int):
    def edit(data):
        data[table].append(copy.deepcopy(data[table][index]))
    return edit


def _duplicate_cross_kv(data):
    cross_kv = _node(data, "decoder")["cross_kv"]
    cross_kv.append(dict(cross_kv[0]))


def _mixed(data):
    return _key(data, "LLM:mixed")


def _snac_key(data):
    return _key(data, "snac_decoder:snac_chunk")


def _talker_prefills_optional(data):
    """qwen3_omni's Talker partition, fed by streams that continue after done, with both prefill
    stages optional: its route can be talker_decode alone (MW218)."""
    for stage in data["partitions"][1]["stages"][:2]:
        stage["is_optional"] = True


def _call_reentered_from_the_loop(data):
    """vjepa2_ac: the rollout call starts the call before the loop again (a cycle through the loop)."""
    _walk(data, "prefill_video_rollout")["calls"][2]["then"] = {"kind": "start", "calls": [1]}


def _encoder_edge(**fields):
    """vjepa2_ac's encoder call (before the rollout loop) with its edge turned into a loop action."""
    return _update(lambda d: _walk(d, "prefill_video_rollout")["calls"][0]["edges"][0], **fields)


# name -> (plan, edit, what the refusal says). Each failed on a mutant of the check that names it.
REFUSED = {
    # references.py: walk indices and names
    "walk of an unknown partition": ("orpheus", _update(lambda d: _walk(d, "prefill"), partition="nowhere"),
                                     "walk prefill: unknown partition 'nowhere'"),
    "walk listing an unknown node": ("orpheus", lambda d: _walk(d, "prefill")["nodes"].append("ghost"),
                                     "walk prefill: unknown node 'ghost'"),
    "join of no members": ("cosmos3", _update(lambda d: _walk(d, "prefill_cond")["joins"][0], num_members=0),
                           "walk prefill_cond: join 0 has 0 members"),
    "start of no call": ("orpheus", _update(lambda d: _walk(d, "prefill")["start"], calls=[]),
                         "walk prefill: its start starts no call"),
    "next call one past the end": ("orpheus", _then("prefill", 0, calls=[1]),
                                   "walk prefill: call 0 names call 1, which the walk lacks"),
    "next call -1": ("orpheus", _then("prefill", 0, calls=[-1]),
                     "walk prefill: call 0 names call -1, which the walk lacks"),
    "loop_end of no target": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0]["then"], target=None),
                              "walk decode: call 0 ends loop_end None, which the walk lacks"),
    "loop_end one past the loops": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0]["then"], target=1),
                                    "walk decode: call 0 ends loop_end 1, which the walk lacks"),
    "stream edge to an unknown node": ("orpheus", _update(_stream_edge, dest="ghost"),
                                       "walk prefill: edge new_token goes to unknown node 'ghost'"),
    "stream edge to an unknown partition": ("orpheus", _update(_stream_edge, stream_partition="ghost"),
                                            "walk prefill: edge new_token streams to unknown partition 'ghost'"),
    "loop-back slot one past the slots": ("orpheus", _update(_loop_back, slot=1),
                                          "call 0 edge text_inputs writes slot 1, which the walk lacks"),
    "loop-back of no slot": ("orpheus", _update(_loop_back, slot=None),
                             "call 0 edge text_inputs writes slot None, which the walk lacks"),
    "loop-back loop one past the loops": ("orpheus", _update(_loop_back, loop=1),
                                          "call 0 edge text_inputs names loop 1, which the walk lacks"),
    "loop output of an unknown exit": ("bagel", _update(_loop_output, exit=5),
                                       "call 0 edge latents names exit 5 of loop 0, which it lacks"),
    "loop output one exit past the exits": ("bagel", _update(_loop_output, exit=1),
                                            "call 0 edge latents names exit 1 of loop 0, which it lacks"),
    "loop output into a scope exit": ("bagel", _update(_exit, kind="scope", edge=None, slot=2),
                                      "call 0 edge latents names exit 0 of loop 0, which it lacks"),
    "call input the node lacks": ("orpheus", _update(lambda d: _walk(d, "prefill")["calls"][0]["inputs"][0],
                                                     name="ghost"),
                                  "walk prefill: LLM is called with 'ghost', not one of its inputs"),
    "call input slot one past the slots": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0]["inputs"][0],
                                                              slots=[1]),
                                           "walk decode: call 0 reads slot 1, which the walk lacks"),
    "call that waits in no slot": ("orpheus", _update(lambda d: _walk(d, "prefill")["calls"][0]["inputs"][0],
                                                      is_wait=True),
                                   "walk prefill: call 0 waits for text_inputs in no slot"),
    "call edge the node does not output": ("orpheus", _update(lambda d: _walk(d, "prefill")["calls"][0]["edges"][1],
                                                              name="ghost"),
                                           "walk prefill: edge ghost is not an output of LLM"),
    "call loop one past the loops": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0], loop=1),
                                     "walk decode: call 0 has loop 1, which the walk lacks"),
    "call stop loop one past the loops": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0], stop_loop=1),
                                          "walk decode: call 0 has stop loop 1, which the walk lacks"),
    # references.py: loops and their exits
    "loop running an unknown node": ("orpheus", lambda d: _loop(d)["nodes"].append("ghost"),
                                     "loop decode_loop runs unknown node 'ghost'"),
    "loop of no iterations": ("orpheus", _update(_loop, max_iters=0), "loop decode_loop has max_iters 0"),
    "count param without a default count": ("vjepa2_ac", _update(lambda d: _loop(d, "prefill_video_rollout"),
                                                                 default_count=None),
                                            "loop rollout_loop has a count param without a default count"),
    "default count 0": ("vjepa2_ac", _update(lambda d: _loop(d, "prefill_video_rollout"), default_count=0),
                        "loop rollout_loop has default_count 0 outside 1..16"),
    "default count past max_iters": ("vjepa2_ac", _update(lambda d: _loop(d, "prefill_video_rollout"),
                                                          default_count=17),
                                     "loop rollout_loop has default_count 17 outside 1..16"),
    "loop body that is not a start": ("orpheus", _update(lambda d: _loop(d)["body"], kind="walk_end"),
                                      "loop decode_loop body is not a start"),
    "loop clearing a slot one past the slots": ("orpheus", _update(_loop, cleared_slots=[1]),
                                                "loop decode_loop clears slot 1, which the walk lacks"),
    "scope exit slot one past the slots": ("bagel", _update(_exit, kind="scope", edge=None, slot=3),
                                           "writes its output latents to slot 3, which the walk lacks"),
    "loop exit of no edge": ("bagel", _update(_exit, edge=None), "loop image_gen.loop0 hands on latents by no edge"),
    "loop exit handed on to the loop itself": ("bagel", _update(lambda d: _exit(d)["edge"], action="loop_output",
                                                                loop=0, exit=0),
                                               "hands latents on to loop 0, not an outer loop"),
    "loop exit edge to an unknown node": ("bagel", _update(lambda d: _exit(d)["edge"], dest="ghost"),
                                          "walk image_gen: edge latents goes to unknown node 'ghost'"),
    # references.py: node roles
    "input without a role": ("orpheus", lambda d: _node(d, "LLM")["input_roles"].pop(),
                             "node LLM: input_roles [] do not match its inputs ['text_inputs']"),
    "stream input that takes the prompt": ("orpheus", _update(lambda d: _node(d, "snac_decoder")["input_roles"][0],
                                                              prompt="text"),
                                           "node snac_decoder: stream input new_token takes the prompt"),
    "kv node that is not a decoder": ("orpheus", _update(lambda d: _node(d, "LLM"), model_kind="audio_codec"),
                                      "node LLM: a kv node cannot be model_kind audio_codec"),
    "output declared twice": ("orpheus", lambda d: _node(d, "LLM")["outputs"].append(_node(d, "LLM")["outputs"][0]),
                              "node LLM: an output is declared twice"),
    "cross_kv from an unknown input": ("whisper", _update(lambda d: _node(d, "decoder")["cross_kv"][0], source="ghost"),
                                       "node decoder: cross_kv audio is filled from 'ghost', not an input"),
    "cross_kv label of a KV sequence": ("whisper", _update(lambda d: _node(d, "decoder")["cross_kv"][0], label="main"),
                                        "node decoder: cross_kv labels ['main'] repeat or clash"),
    "cross_kv label twice": ("whisper", _duplicate_cross_kv,
                             "node decoder: cross_kv labels ['audio', 'audio'] repeat or clash"),
    "kv access of an unknown walk": ("whisper", _update(lambda d: _node(d, "decoder")["kv_access"][0], walk="ghost"),
                                     "node decoder: kv access of unknown walk 'ghost'"),
    "kv access reading a walk's name": ("whisper", _update(lambda d: _node(d, "decoder")["kv_access"][1],
                                                           reads=["decode"]),
                                        "node decoder: walk decode uses unknown KV sequence 'decode'"),
    "kv access writing an unknown sequence": ("whisper", _update(lambda d: _node(d, "decoder")["kv_access"][1],
                                                                 writes=["ghost"]),
                                              "node decoder: walk decode uses unknown KV sequence 'ghost'"),
    "guidance on the first sequence": ("bagel", _update(lambda d: _node(d, "LLM")["guidance"][0], label="main"),
                                       "node LLM: guidance label 'main' is not one of its KV sequences after the "
                                       "first"),
    # references.py: names declared twice, kv pools, stages
    "walk declared twice": ("orpheus", _duplicate("walks", 0), "walk prefill is declared twice"),
    "partition declared twice": ("orpheus", _duplicate("partitions", 1), "partition SNAC is declared twice"),
    "worker rank declared twice": ("orpheus", _update(lambda d: d["workers"][1], rank=0),
                                   "worker rank 0 is declared twice"),
    "kv pool of an unknown node": ("orpheus", _update(lambda d: d["deployment"]["kv_pools"][0], node="ghost"),
                                   "kv pool of unknown node 'ghost'"),
    "kv pool of no pages": ("orpheus", _update(lambda d: d["deployment"]["kv_pools"][0], num_pages=0),
                            "kv pool of LLM: page_size, num_pages and max_seq_len must be positive"),
    "kv pool of no sequence length": ("orpheus", _update(lambda d: d["deployment"]["kv_pools"][0], max_seq_len=0),
                                      "kv pool of LLM: page_size, num_pages and max_seq_len must be positive"),
    "stage sequence of length 0": ("higgs_audio", _update(lambda d: d["partitions"][0]["stages"][1],
                                                          sequence_lengths=[2, 0]),
                                   "partition LLM: stage sequence lengths [2, 0] do not split its 2 walks"),
    "stage sequence lengths short of its walks": ("higgs_audio", _update(lambda d: d["partitions"][0]["stages"][1],
                                                                         sequence_lengths=[1]),
                                                  "partition LLM: stage sequence lengths [1] do not split its 2 walks"),
    "initial walk unknown": ("orpheus", _update(lambda d: d["partitions"][0], initial_walk="ghost"),
                             "partition LLM: initial walk 'ghost' is not a walk"),
    # references.py: capture families, workers, keys and mixtures
    "capture touching a stateless node's sequence": ("orpheus", _update(lambda d: _snac_key(d)["captures"][0],
                                                                        labels=["main"]),
                                                     "capture snac_decoder:snac_chunk touches 'main', not a KV "
                                                     "sequence of snac_decoder"),
    "guided capture on a node without guidance": ("orpheus", _update(lambda d: _mixed(d)["captures"][0],
                                                                     guidance="guided"),
                                                  "capture LLM:decode is guided on LLM, which has no guidance "
                                                  "sequences"),
    "placement of an unknown walk": ("orpheus", lambda d: d["workers"][0]["placements"].append("LLM/ghost"),
                                     "worker 0: placement 'LLM/ghost' names an unknown node or walk"),
    "placement of an unknown node": ("orpheus", lambda d: d["workers"][0]["placements"].append("ghost/decode"),
                                     "worker 0: placement 'ghost/decode' names an unknown node or walk"),
    "a call started twice": ("llama", lambda d: d["walks"][0]["start"].__setitem__("calls", [0, 0]),
                             "its start names call 0 twice"),
    # (no "/": the rank checks' split raised ValueError, an internal error from mstar run and mstarc)
    "placement without a walk": ("llama", lambda d: d["workers"][0]["placements"].__setitem__(0, "zz"),
                                 "worker 0: placement 'zz' names an unknown node or walk"),
    "placement keyed to a key of another walk": ("bagel", lambda d: d["workers"][1]["walk_to_key"].update(
                                                     {"LLM/decode": "LLM:image_gen"}),
                                                 "walk_to_key[LLM/decode] is key LLM:image_gen, which does not run "
                                                 "LLM/decode"),
    "placement keyed to a key of another node": ("orpheus", _update(_snac_key, node="LLM"),
                                                 "walk_to_key[snac_decoder/snac_chunk] is key snac_decoder:snac_chunk, "
                                                 "which does not run snac_decoder/snac_chunk"),
    "key of an unknown node": ("orpheus", _update(_snac_key, node="ghost"),
                               "key snac_decoder:snac_chunk of unknown node 'ghost'"),
    "key of no walks and no mixtures": ("orpheus", _update(_snac_key, walks=[], mixtures=[]),
                                        "key snac_decoder:snac_chunk has 0 mixtures for 0 walks (needs 1)"),
    "rows limit of an unknown walk": ("orpheus", lambda d: _mixed(d)["rows_limits"].update(ghost=4),
                                      "key LLM:mixed limits unknown walk 'ghost'"),
    "batch rules of a walk the key lacks": ("orpheus", _update(_snac_key, batch_rules={"ghost": ["shape"]}),
                                            "batch_rules for walk ghost, which is not in the key"),
    "combined key with batch rules": ("orpheus", _update(_mixed, batch_rules={"decode": ["shape"]}),
                                      "key LLM:mixed: a combined key with batch_rules"),
    "speculation for a placement the worker lacks": (
        "orpheus", lambda d: d["workers"][0]["speculation"].append(
            {"can_speculate": False, "mixes_walks": False, "node": "snac_decoder", "walk": "snac_chunk"}),
        "worker 0: speculation for snac_decoder/snac_chunk, which it does not run"),
    "empty step with a cap": ("orpheus", _update(lambda d: _mixed(d)["mixtures"][0], cap=4),
                              "mixtures[0] (the empty step) has cap 4"),
    "also_captures without a capture": ("bagel", _update(lambda d: _mixed(d)["mixtures"][2], capture=None),
                                        "mixtures[2] lists also_captures without a capture"),
    "also_captures of an unknown family": ("bagel", _update(lambda d: _mixed(d)["mixtures"][2],
                                                            also_captures=["ghost"]),
                                           "mixtures[2].also_captures names 'ghost', which is not another capture"),
    "also_captures of the step's own capture": ("bagel", _update(lambda d: _mixed(d)["mixtures"][2],
                                                                 also_captures=["LLM:decode"]),
                                                "mixtures[2].also_captures names 'LLM:decode', which is not another"),
    "also_captures naming a family twice": ("bagel", _update(lambda d: _mixed(d)["mixtures"][2],
                                                             also_captures=["LLM:decode#2", "LLM:decode#2"]),
                                            "mixtures[2].also_captures names 'LLM:decode#2', which is not another"),
    "batch sizes unsorted": ("orpheus", _update(lambda d: _family(_mixed(d), "LLM:prefill"),
                                                batch_sizes=[2, 1, 4, 8, 16]),
                             "capture LLM:prefill: batch_sizes [2, 1, 4, 8, 16] must be positive, sorted, distinct"),
    "batch size 0": ("orpheus", _update(lambda d: _family(_mixed(d), "LLM:prefill"), batch_sizes=[0, 1, 2, 4, 8, 16]),
                     "capture LLM:prefill: batch_sizes [0, 1, 2, 4, 8, 16] must be positive, sorted, distinct"),
    "token bucket 0": ("orpheus", _update(lambda d: _family(_mixed(d), "LLM:prefill"),
                                          token_buckets=[0, 32, 64, 128, 256, 512, 1024]),
                       "capture LLM:prefill: token_buckets [0, 32, 64, 128, 256, 512, 1024] must be positive"),
    "packed family without token buckets": ("orpheus", _update(lambda d: _family(_mixed(d), "LLM:prefill"),
                                                               token_buckets=[]),
                                            "capture LLM:prefill: token_buckets [] must be positive, sorted, distinct"),
    "batched family with token buckets": ("orpheus", _update(lambda d: _snac_key(d)["captures"][0],
                                                             token_buckets=[128]),
                                          "capture snac_decoder:snac_chunk: a batched family has token_buckets [128]"),
    # rank_checks.py
    "TP group of more ranks than tp x sp": ("orpheus_tp2", _tp_group(tp_size=1),
                                            "TP group of LLM with ranks [0, 1] has 2 ranks for tp_size 1 x sp_size 1"),
    "TP group of fewer ranks than tp x sp": ("orpheus_tp2", _tp_group(sp_size=2),
                                             "TP group of LLM with ranks [0, 1] has 2 ranks for tp_size 2 x sp_size 2"),
    "TP group of tp_size 0 and no ranks": ("orpheus_tp2", _tp_group(ranks=[], tp_size=0),
                                           "TP group of LLM with ranks [] has 0 ranks for tp_size 0 x sp_size 1"),
    "TP group its follower lists otherwise": ("orpheus_tp2", lambda d: d["workers"][0]["tp_groups"][0].update(
                                                  walks=["decode"]),
                                              "worker 0: TP group of LLM with ranks [0, 1] holds rank 1, which does "
                                              "not list this group"),
    "instance of an unknown rank and a rank off the walk": (
        "orpheus", _update(lambda d: _walk(d, "decode")["calls"][0], instances=[[7, 1]]),
        "walk decode: call 0 (LLM) runs on rank 1, whose worker does not run LLM/decode"),
    # loop_nesting.py (on generated plans: one loop a walk)
    "call outside the loop ending its iteration": ("vjepa2_ac", _update(
                                                       lambda d: _walk(d, "prefill_video_rollout")["calls"][1],
                                                       then={"kind": "loop_end", "target": 0}),
                                                   "call 1 (rollout_predictor) ends an iteration of loop 0 "
                                                   "(rollout_loop), but the innermost loop around it is no loop"),
    "walk ended inside its loop": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0],
                                                      then={"kind": "walk_end"}),
                                   "walk decode: call 0 (LLM) ends the walk inside loop 0 (decode_loop)"),
    "call reached inside and outside the loop": ("vjepa2_ac", _call_reentered_from_the_loop,
                                                 "walk prefill_video_rollout: call 1 is reached inside loops [] and "
                                                 "inside loops [0]"),
    "loop body entering its own loop": ("orpheus", _update(lambda d: _loop(d)["body"], loops=[0]),
                                        "walk decode: loop decode_loop enters loop 0 (decode_loop), which is already "
                                        "around it"),
    "call in the loop with no loop": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0], loop=None),
                                      "walk decode: call 0 (LLM) has loop None, but the innermost loop around it is "
                                      "loop 0 (decode_loop)"),
    "call in the stop loop with no stop loop": ("orpheus", _update(lambda d: _walk(d, "decode")["calls"][0],
                                                                   stop_loop=None),
                                                "walk decode: call 0 (LLM) has stop_loop None, but the innermost "
                                                "has_stop loop around it is loop 0 (decode_loop)"),
    "loop-back written before the loop": ("vjepa2_ac", _encoder_edge(action="loop_back", loop=0),
                                          "call 0 (video_encoder) edge encoder_hidden (loop_back) writes loop 0 "
                                          "(rollout_loop), which is not around it"),
    "accumulation written before the loop": ("vjepa2_ac", _encoder_edge(action="loop_accumulate", loop=0, exit=0,
                                                                        slot=None),
                                             "call 0 (video_encoder) edge encoder_hidden (loop_accumulate) writes "
                                             "loop 0 (rollout_loop), which is not around it"),
    # stream_checks.py
    "window of stride 0": ("orpheus", _policy(1, stride=0), "stream new_token: a window policy has stride 0"),
    "window with a context": ("orpheus", _policy(1, context=3), "stream new_token: a window policy has context 3"),
    "left_context without a context": ("qwen3_tts", _policy(1, context=None),
                                       "stream codec_tokens: a left_context policy has context None"),
    "window that continues after done": ("orpheus", _policy(1, is_continue_after_done=True),
                                         "stream new_token: a window policy continues after done (only a fixed one "
                                         "can)"),
    "stream from an unknown partition": ("orpheus", _update(lambda d: d["partitions"][1]["streams"][0],
                                                            producer_partition="ghost"),
                                         "partition SNAC: stream from unknown partition 'ghost'"),
    "stream into an unknown node": ("orpheus", _update(lambda d: d["partitions"][1]["streams"][0],
                                                       consumer_node="ghost"),
                                    "partition SNAC: stream into unknown node 'ghost'"),
    "stream input taken by another node": ("orpheus", _update(lambda d: _walk(d, "snac_chunk")["calls"][0], node="LLM"),
                                           "partition SNAC: no walk of the partition calls snac_decoder on stream "
                                           "new_token"),
    "continue-after-done streams into a route that can be one walk": (
        "qwen3_omni", _talker_prefills_optional,
        "partition Talker: stream thinker_states continues after done into a partition whose one-walk route"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_hand_edited_plan_is_refused_with_its_problem_named(name, tmp_path):
    plan_name, edit, fragment = REFUSED[name]
    plan = _edited(plan_name, edit)
    problems = reference_problems(plan)
    assert any(fragment in problem for problem in problems), problems
    with pytest.raises(PlanError, match="its tables do not fit together") as error:
        load_plan(_written(plan, plan_name, tmp_path), verify=False)
    assert "edited by hand. Recompile: mstarc compile" in str(error.value)


def _cross_kv_in_a_capture(data):
    """orpheus' LLM with a cross-attention pool that its decode capture family touches."""
    _node(data, "LLM")["cross_kv"].append({"label": "audio", "source": "text_inputs", "num_tokens": 4})
    _family(_mixed(data), "LLM:decode")["labels"] = ["main", "audio"]


def _talker_as_one_sequence(data):
    """qwen3_omni's Talker route as one stage holding a sequence of its three walks: never one walk."""
    data["partitions"][1]["stages"] = [{"is_optional": False, "sequence_lengths": [3],
                                        "walks": ["talker_prefill", "talker_last_prefill", "talker_decode"]}]


# name -> (plan, edit): consistent edits at the edges of what the checks allow.
ACCEPTED = {
    "default count 1": ("vjepa2_ac", _update(lambda d: _loop(d, "prefill_video_rollout"), default_count=1)),
    "default count max_iters": ("vjepa2_ac", _update(lambda d: _loop(d, "prefill_video_rollout"), default_count=16)),
    "capture touching a cross_kv pool": ("orpheus", _cross_kv_in_a_capture),
    "batch rules of the key's walk": ("orpheus", _update(_snac_key, batch_rules={"snac_chunk": ["shape"]})),
    "TP group of tp 1 x sp 2": ("orpheus_tp2", _tp_group(tp_size=1, sp_size=2)),
    "continue-after-done streams into a route of three walks": ("qwen3_omni", _talker_as_one_sequence),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_a_consistent_edit_is_accepted(name, tmp_path):
    plan_name, edit = ACCEPTED[name]
    plan = _edited(plan_name, edit)
    assert reference_problems(plan) == []
    assert load_plan(_written(plan, plan_name, tmp_path), verify=False) == plan


def test_instances_without_tp_groups_are_named_once_by_their_cause():
    """Instances that the workers' TP groups do not give are named by what is missing (the TP group
    of each worker), not also as instances that differ from the expected ones; and a TP instance cut
    to one rank is named as that, not also as a KV cache at two TP world sizes (a consequence)."""
    def no_tp_groups(data):
        for worker in data["workers"]:
            worker["tp_groups"] = []
    problems = reference_problems(_edited("orpheus_tp2", no_tp_groups))
    assert len(problems) == 4 and all("lists no TP group for LLM/" in p for p in problems), problems
    cut = reference_problems(_edited("orpheus_tp2", _update(lambda d: _walk(d, "decode")["calls"][0],
                                                            instances=[[0]])))
    assert cut == ["walk decode: call 0 (LLM) has instances [[0]], but its workers' placements and TP groups "
                   "give [[0, 1]]"]


# ---------------------------------------------------------------- loops inside loops (lowered by mstarc)

class _Walk:
    """A walk of stateless calls lowered by mstarc (compiler/lower_tables.py), built from sections:
    each call loops back into itself inside a loop and sends `out` to the client, a loop output
    where its loop says so."""

    def __init__(self):
        self.nodes: list[str] = []
        self.loops = 0

    def call(self, in_loop: bool) -> TreeCall:
        node = f"n{len(self.nodes)}"
        self.nodes.append(node)
        edges = [TreeEdge(name="out", dest_kind="client", modality="text")]
        if in_loop:
            edges.append(TreeEdge(name="back", dest_kind="node", dest=node, is_loop_back=True))
        return TreeCall(node=node, inputs=["back"], edges=edges)

    def loop(self, *body, has_stop: bool = True, outputs: bool = False):
        def make(in_loop: bool) -> TreeLoop:
            name = f"l{self.loops}"
            self.loops += 1
            return TreeLoop(name=name, max_iters=2, has_stop=has_stop, nodes=[], loop_back=[], is_on_device=False,
                            outputs=["out"] if outputs else [], accumulate=[], body=[part(True) for part in body])
        return make

    def parallel(self, *body):
        return lambda in_loop: TreeParallel(body=[part(in_loop) for part in body])

    def lowered(self, *body) -> WalkPlan:
        tree = WalkTree(name="w", partition="P", nodes=self.nodes, body=[part(False) for part in body])
        nodes = [NodePlan(name=n, engine="stateless", model_kind="audio_codec", dims={}, inputs=["back"],
                          input_roles=[], outputs=[]) for n in self.nodes]
        partitions = [PartitionPlan(name="P", stages=[StagePlan(walks=["w"])], initial_walk="w")]
        walk = lower_walk_tables([tree], partitions, nodes, {(n, "w"): [[0]] for n in self.nodes})[0]
        assert loop_nesting_problems(walk) == []  # as mstarc writes it
        return walk


def _nested(outer_stop: bool = True, inner_stop: bool = True) -> WalkPlan:
    """Loop 1 inside loop 0, around call 0."""
    w = _Walk()
    return w.lowered(w.loop(w.loop(w.call, has_stop=inner_stop), has_stop=outer_stop))


def _with_call(walk: WalkPlan, index: int, **fields) -> WalkPlan:
    calls = list(walk.calls)
    calls[index] = calls[index].model_copy(update=fields)
    return walk.model_copy(update={"calls": calls})


@pytest.mark.parametrize("outer_stop, inner_stop, stop_loop", [(True, True, 1), (True, False, 0), (False, True, 1)])
def test_nested_loops_as_mstarc_writes_them(outer_stop, inner_stop, stop_loop):
    """The call sits in both loops: its loop is the inner one, its stop loop the innermost has_stop."""
    walk = _nested(outer_stop, inner_stop)
    assert (walk.calls[0].loop, walk.calls[0].stop_loop) == (1, stop_loop)
    assert loop_nesting_problems(walk) == []


def test_a_call_in_nested_loops_names_the_innermost():
    walk = _nested()
    problems = loop_nesting_problems(_with_call(walk, 0, loop=0))
    assert problems == ["walk w: call 0 (n0) has loop 0, but the innermost loop around it is loop 1 (l1)"]
    problems = loop_nesting_problems(_with_call(walk, 0, then=walk.calls[0].then.model_copy(update={"target": 0})))
    assert problems == ["walk w: call 0 (n0) ends an iteration of loop 0 (l0), but the innermost loop around it is "
                        "loop 1 (l1)"]


def test_a_loop_exit_written_to_a_loop_not_around_it():
    """Two loops one after the other, each with an output: the second loop's exit edge rewritten to
    hand its output to the first loop (an earlier index, so the index check lets it through)."""
    w = _Walk()
    walk = w.lowered(w.loop(w.call, outputs=True), w.loop(w.call, outputs=True))
    loops = list(walk.loops)
    exit = loops[1].exits[0]
    edge = exit.edge.model_copy(update={"action": "loop_output", "loop": 0, "exit": 0})
    loops[1] = loops[1].model_copy(update={"exits": [exit.model_copy(update={"edge": edge})]})
    problems = loop_nesting_problems(walk.model_copy(update={"loops": loops}))
    assert problems == ["walk w: loop l1 edge out (loop_output) writes loop 0 (l0), which is not around it"]


def test_a_join_reached_inside_and_outside_its_loop():
    """A parallel section inside a loop whose body leaves out one member: that member starts outside
    the loop, so the join is reached inside loops [0] and inside loops []."""
    w = _Walk()
    walk = w.lowered(w.loop(w.parallel(w.call, w.call)))
    loops = list(walk.loops)
    loops[0] = loops[0].model_copy(update={"body": loops[0].body.model_copy(update={"calls": [0]})})
    problems = loop_nesting_problems(walk.model_copy(update={"loops": loops}))
    assert any(p.startswith("walk w: join 0 is reached inside loops ") for p in problems), problems


def test_the_calls_after_a_join_are_checked_too():
    """A parallel section, then a loop: the loop's call is reached through the join's transition."""
    w = _Walk()
    walk = w.lowered(w.parallel(w.call, w.call), w.loop(w.call))
    assert walk.joins[0].then.loops == [0] and walk.calls[2].loop == 0
    problems = loop_nesting_problems(_with_call(walk, 2, loop=None))
    assert problems == ["walk w: call 2 (n2) has loop None, but the innermost loop around it is loop 0 (l0)"]


# ---------------------------------------------------------------- io.py: the file itself

@pytest.mark.parametrize("value, refusal", [
    ("9223372036854775807", "has schema version 9223372036854775807"),  # int64's largest: read, its version refused
    ("9223372036854775808", "integer 9223372036854775808 is out of range"),
    ("9999999999999999999", "integer 9999999999999999999 is out of range"),  # 19 digits, past int64
    ("-9223372036854775808", "has schema version -9223372036854775808"),  # int64's smallest: read
    ("-9223372036854775809", "integer -9223372036854775809 is out of range"),
])
def test_plan_integers_at_the_edge_of_int64(tmp_path, value, refusal):
    path = tmp_path / "x.plan"
    path.write_text('{"header": {"schema_version": ' + value + '}}')
    with pytest.raises(PlanError, match=refusal):
        load_plan(path)


def test_a_plan_path_with_a_nul_byte_is_named_as_such(tmp_path):
    with pytest.raises(PlanError, match="may not contain a NUL byte"):
        load_plan(str(tmp_path / "a\0b.plan"))


@pytest.mark.parametrize("glue", ["..\\evil_glue.py", "evil\\x_glue.py", "a\0_glue.py"])
def test_a_glue_name_with_a_backslash_or_nul_is_refused(tmp_path, glue):
    """The runtime imports the glue the plan names: a backslash (a separator on Windows) or a NUL
    in its name is refused before anything reads it, as a name with a slash is."""
    data = json.loads((ROOT / "generated" / "llama.plan").read_text())
    data["header"]["glue_path"] = glue
    plan = Plan.model_validate(data)
    plan = plan.model_copy(update={"header": plan.header.model_copy(update={"content_sha256": content_hash(plan)})})
    with pytest.raises(PlanError, match="names its glue"):
        load_plan(_written(plan, "llama", tmp_path), verify=False)


@pytest.fixture
def orpheus_beside_its_sources(tmp_path) -> Path:
    return written_beside_its_sources(load_plan(ROOT / "generated" / "orpheus.plan"), "orpheus", tmp_path)


@pytest.mark.parametrize("what, rel, limit", [("spec", "specs/orpheus.mw", MAX_SPEC_BYTES),
                                              ("deployment", "configs/orpheus.yaml", MAX_DEPLOYMENT_BYTES),
                                              ("glue", "generated/orpheus_glue.py", MAX_GLUE_BYTES)])
def test_an_input_over_its_own_limit_is_not_read(orpheus_beside_its_sources, what, rel, limit):
    """Each input is re-hashed within its own kind's limit (docs/limits.md), not the plan's."""
    plan = orpheus_beside_its_sources
    (plan.parent.parent / rel).write_bytes(b"#" * (limit + 1))
    with pytest.raises(PlanError, match=f"cannot read its {what} file .*over the limit of {limit} bytes"):
        load_plan(plan)


def test_a_glue_under_its_limit_is_read_and_found_stale(orpheus_beside_its_sources):
    """The glue's limit is its own (4 MiB), not the spec's (1 MiB): a larger glue is hashed."""
    plan = orpheus_beside_its_sources
    assert MAX_SPEC_BYTES < MAX_GLUE_BYTES
    plan.with_name("orpheus_glue.py").write_bytes(b"#" * (MAX_SPEC_BYTES + 1))
    with pytest.raises(PlanError, match="is stale: its glue file"):
        load_plan(plan)


def test_a_missing_glue_is_not_called_a_moved_plan(orpheus_beside_its_sources):
    """The glue sits beside the plan: it missing is not the plan moved away from its inputs."""
    plan = orpheus_beside_its_sources
    plan.with_name("orpheus_glue.py").unlink()
    with pytest.raises(PlanError, match="cannot read its glue file") as error:
        load_plan(plan)
    assert "moved or copied away" not in str(error.value)


def test_a_plan_over_its_size_limit_is_not_read(tmp_path):
    """A plan file past MAX_PLAN_BYTES is refused unread, even when it is a valid plan padded out."""
    text = (ROOT / "generated" / "llama.plan").read_text()
    path = tmp_path / "llama.plan"
    path.write_text(text + " " * (MAX_PLAN_BYTES + 1 - len(text.encode())))
    with pytest.raises(PlanError, match=f"cannot read plan .*over the limit of {MAX_PLAN_BYTES} bytes"):
        load_plan(path, verify=False)
    path.write_text(text + " " * 16)  # the same plan under the limit loads
    assert load_plan(path, verify=False).header.model == "llama"


@pytest.mark.parametrize("edit", [
    lambda d: d["workers"][0]["keys"][0]["mixtures"][3].update(cap=10**12),
    lambda d: d["workers"][0]["keys"][0]["captures"][0].update(
        batch_sizes=d["workers"][0]["keys"][0]["captures"][0]["batch_sizes"] + [10**12]),
], ids=["cap", "batch_size"])
def test_a_huge_cap_or_batch_size_is_refused_without_building_its_table(edit, tmp_path):
    """The batch_pad check compares the table's length before it rebuilds the table: a tampered cap
    of 10**12 had it build 10**12 entries (out of memory where the plan should be refused)."""
    plan = _edited("orpheus", edit)
    problems = reference_problems(plan)
    assert any("batch_pad has" in p and "entries" in p for p in problems), problems
    with pytest.raises(PlanError, match="do not fit together"):
        load_plan(str(_written(plan, "orpheus", tmp_path)), verify=False)
