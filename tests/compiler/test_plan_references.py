"""A plan whose tables do not fit together (edited by hand, hash recomputed) is refused by load_plan
with the problem named, instead of failing inside the scheduler or conductor."""
import json
from pathlib import Path

import pytest

from mstar.cli.mstarc import main as mstarc_main
from mstar.plan.io import PlanError, dump_plan, load_plan
from mstar.plan.references import reference_problems
from mstar.plan.schema import Plan
from plan_files import edited_plan, rehashed, written_beside_its_sources

ROOT = Path(__file__).resolve().parents[2]


def _edge_to_nowhere(data):
    prefill = next(w for w in data["walks"] if w["name"] == "prefill")
    prefill["calls"][0]["edges"][0].update(dest_kind="node", dest="nowhere")


def _codec_called_without_its_stream(data):
    chunk = next(w for w in data["walks"] if w["name"] == "snac_chunk")
    chunk["calls"][0]["inputs"] = []  # the run hung: the stream's chunks never had a consumer


def _stream_input_renamed(data):
    next(n for n in data["nodes"] if n["name"] == "snac_decoder")["stream_inputs"] = ["LLM"]  # hung too


def _key(data, name="LLM:mixed"):
    return next(k for k in data["workers"][0]["keys"] if k["name"] == name)


def _family(data, name="LLM:prefill"):
    return next(c for c in _key(data)["captures"] if c["name"] == name)


def _pad_to_uncaptured_size(data):
    _family(data)["batch_pad"][3] = 3  # batch_sizes [1, 2, 4, 8, 16]: 3 rows would "replay" a size never captured


def _batch_sizes_without_their_table(data):
    _family(data)["batch_sizes"] = [1, 2, 8, 16]  # batch_pad still pads 3 rows to 4


def _walk(data, name):
    return next(w for w in data["walks"] if w["name"] == name)


def _next_call_out_of_range(data):
    _walk(data, "prefill")["calls"][0]["then"] = {"kind": "start", "calls": [7]}


def _slot_out_of_range(data):
    decode = _walk(data, "decode")
    next(e for e in decode["calls"][0]["edges"] if e["action"] == "loop_back")["slot"] = 5


def _loop_exit_ends_itself(data):
    decode = _walk(data, "decode")
    decode["loops"][0]["then"] = {"kind": "loop_end", "target": 0}  # would end its iteration forever


def _unknown_rank(data):
    _walk(data, "decode")["calls"][0]["instances"] = [[7]]


EDITS = {
    "batch_pad pads to an uncaptured size": (_pad_to_uncaptured_size,
                                             "batch_pad disagrees with batch_sizes [1, 2, 4, 8, 16]: it pads 3 "
                                             "rows to 3, batch_sizes give 4"),
    "batch_sizes edited without batch_pad": (_batch_sizes_without_their_table,
                                             "batch_pad disagrees with batch_sizes [1, 2, 8, 16]"),
    "token buckets unsorted": (lambda d: _family(d).update(token_buckets=[64, 32, 128]),
                               "token_buckets [64, 32, 128] must be positive, sorted, distinct"),
    "mixture mask disagrees with its index": (lambda d: _key(d)["mixtures"][1].update(mask=2),
                                              "mixtures[1] has mask 2"),
    "mixture walks disagree with the key": (lambda d: _key(d)["mixtures"][1].update(walks=["decode"]),
                                            "mixtures[1].walks is ['decode'], mask 1 holds ['prefill']"),
    "mixture label of another walk": (lambda d: _key(d)["mixtures"][2].update(label="prefill"),
                                      "mixtures[2].label is 'prefill', mask 2 needs 'decode'"),
    "mixture without a cap": (lambda d: _key(d)["mixtures"][3].update(cap=0), "mixtures[3] (mask 3) has cap 0"),
    "mixture replays a capture that does not exist": (lambda d: _key(d)["mixtures"][3].update(capture="LLM:other"),
                                                      "mixtures[3] replays unknown capture 'LLM:other'"),
    "kv mixture without attention": (lambda d: _key(d)["mixtures"][3].update(attention="none"),
                                     "mixtures[3].attention is none on kv node LLM"),
    "key walks out of their mixtures' order": (lambda d: _key(d).update(walks=["decode", "prefill"]),
                                               "mixtures[1].walks is ['prefill'], mask 1 holds ['decode']"),
    "walk_to_key names another key": (lambda d: d["workers"][1]["walk_to_key"].update(
                                          {"snac_decoder/snac_chunk": "LLM:mixed"}),
                                      "walk_to_key[snac_decoder/snac_chunk] is 'LLM:mixed', not this key"),
    "rows limit of zero": (lambda d: _key(d).update(rows_limits={"prefill": 0}), "rows_limits[prefill] is 0"),
    "next call out of range": (_next_call_out_of_range, "names call 7, which the walk lacks"),
    "slot out of range": (_slot_out_of_range, "writes slot 5, which the walk lacks"),
    "loop exit ends itself": (_loop_exit_ends_itself, "ends loop 0 when it exits, not an outer loop"),
    "call on an unknown rank": (_unknown_rank, "runs on rank 7, which the plan lacks"),
    "stream chunks without a consumer call": (_codec_called_without_its_stream, "would wait forever"),
    "stream input renamed": (_stream_input_renamed, "which has no such stream input"),
    "placement without a key": (lambda d: d["workers"][0]["walk_to_key"].clear(), "has no scheduling key"),
    "stage walk renamed": (lambda d: d["partitions"][0]["stages"][0]["walks"].__setitem__(0, "prefil"),
                           "stage walk 'prefil' is not a walk"),
    # the conductor took the first alternative of the stage: IndexError
    "stage without walks": (lambda d: d["partitions"][0]["stages"][0].update(walks=[]),
                            "partition LLM: stage 0 has no walks"),
    "optional stage without walks": (lambda d: d["partitions"][0]["stages"][1].update(walks=[], is_optional=True),
                                     "partition LLM: stage 1 has no walks"),
    "partition without stages": (lambda d: d["partitions"][0].update(stages=[]), "partition LLM has no stages"),
    "initial walk not the first stage's": (lambda d: d["partitions"][0].update(initial_walk="decode"),
                                           "initial walk decode is not the first walk of its first stage"),
    "zero page size": (lambda d: d["deployment"]["kv_pools"][0].update(page_size=0),
                       "page_size, num_pages and max_seq_len must be positive"),
    "key walk unknown": (lambda d: d["workers"][0]["keys"][0]["walks"].__setitem__(0, "x"), "has unknown walk 'x'"),
    "mixtures cut": (lambda d: d["workers"][0]["keys"][0]["mixtures"].pop(), "mixtures for"),
    "edge to nowhere": (_edge_to_nowhere, "unknown node 'nowhere'"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_hand_edited_plans_are_refused(name, tmp_path):
    edit, fragment = EDITS[name]
    plan = edited_plan("orpheus", edit)
    assert any(fragment in problem for problem in reference_problems(plan)), reference_problems(plan)
    path = written_beside_its_sources(plan, "orpheus", tmp_path)
    with pytest.raises(PlanError, match="tables do not fit together") as error:
        load_plan(path)
    assert fragment in str(error.value) and "mstarc compile" in str(error.value)


def test_an_empty_stage_is_refused_by_the_commands(tmp_path, capsys):
    """The audit's reproduction: llama's plan with its first stage emptied (content hash recomputed)
    crashed `mstar bench lone` with an IndexError; explain and the runtime's loader now refuse it."""
    data = json.loads((ROOT / "generated" / "llama.plan").read_text())
    data["partitions"][0]["stages"][0]["walks"] = []
    plan = rehashed(Plan.model_validate(data))
    path = written_beside_its_sources(plan, "llama", tmp_path)
    assert mstarc_main(["explain", str(path)]) == 1
    err = capsys.readouterr().err
    assert "stage 0 has no walks" in err and "Traceback" not in err


def test_compiled_plans_have_no_problems():
    for path in sorted((ROOT / "generated").glob("*.plan")):
        assert reference_problems(load_plan(path)) == [], path.name


def test_a_plan_naming_its_glue_elsewhere_is_refused(tmp_path):
    """The runtime imports the glue a plan names: a plan edited to name a file outside its own
    directory (its content hash recomputed) is refused before anything is imported."""
    data = json.loads((ROOT / "generated" / "llama.plan").read_text())
    for named in ("../specs/evil_glue.py", "/tmp/evil_glue.py", "evil.py"):
        data["header"]["glue_path"] = named
        plan = rehashed(Plan.model_validate(data))
        path = tmp_path / "llama.plan"
        path.write_text(dump_plan(plan))
        with pytest.raises(PlanError, match="names its glue"):
            load_plan(path, verify=False)
