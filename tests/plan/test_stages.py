"""`mstar/plan/stages.py`: a stage's alternatives (one walk each, or sequences split by
`sequence_lengths`) and the walks of a partition's default route (the first alternative of every
stage that is not optional), the one reading the conductor, the engines and the server share."""
from mstar.plan.io import load_plan
from mstar.plan.schema import PartitionPlan, StagePlan
from mstar.plan.stages import alternatives, default_walks

from plan_files import ROOT


def test_one_walk_an_alternative_without_sequence_lengths():
    assert alternatives(StagePlan(walks=["a", "b"])) == [["a"], ["b"]]


def test_sequences_are_split_by_their_lengths_in_order():
    stage = StagePlan(walks=["a1", "a2", "b", "c1", "c2", "c3"], sequence_lengths=[2, 1, 3])
    assert alternatives(stage) == [["a1", "a2"], ["b"], ["c1", "c2", "c3"]]


def test_the_default_route_takes_the_first_alternative_of_every_required_stage():
    part = PartitionPlan(name="p", initial_walk="x", stages=[
        StagePlan(walks=["x1", "x2", "y"], sequence_lengths=[2, 1]),
        StagePlan(walks=["skipped"], is_optional=True),
        StagePlan(walks=["decode", "other"])])
    assert default_walks(part) == ["x1", "x2", "decode"]


def test_plans_default_routes_skip_optional_stages():
    omni = load_plan(ROOT / "generated" / "qwen3_omni.plan", verify=False)
    assert {part.name: default_walks(part) for part in omni.partitions}["Thinker"] == ["prefill_text", "thinker_decode"]
    higgs = load_plan(ROOT / "generated" / "higgs_audio.plan", verify=False)
    (llm,) = higgs.partitions  # its optional stage is a sequence: (prefill_audio -> prefill_text)?
    assert alternatives(llm.stages[1]) == [["prefill_audio", "prefill_text"]]
    assert default_walks(llm) == ["prefill_text", "decode"]
