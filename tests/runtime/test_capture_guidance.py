"""Capture keys per guidance mode and KV labels (`guided` / `unguided`, `labels=[...]`).

The compiler lowers each capture's mode and sequences into its plan family (`guidance`, `labels`)
and counts a row once per sequence in the memory estimate; a step is guided when one of its rows'
requests requires guidance on the node (plan/guidance_mode.py), and it replays only families of
its mode or of both, in the fast scheduler and the baseline alike (else it runs eagerly); the step
carries its mode and the step contract refuses a family of the other mode, a guided step on a node
without guidance, and a mode that is not its rows' own."""
import pytest
from runtime_plans import generated
from spec_text import plan_of

from mstar.compiler.capture_memory import estimate_family_bytes
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse
from mstar.plan.guidance_mode import GuidanceRule
from mstar.runtime.conductor.batch_class import batch_classes
from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.step_check import StepChecker, StepContractError
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.scheduler import WorkerScheduler
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.steps import recompose
from mstar.runtime.step import Step, StepRow

SPEC = """model keyed
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    kv_sequences main cfg
    guidance cfg drops image scale=2.0
    kv prefill writes main cfg
    kv decode writes main cfg
    kv probe reads main cfg
    cap decode 8
    capture decode batched batch=[1, 2, 4, 8] unguided labels=[main]
    capture decode batched batch=[1, 2, 4] guided labels=[main, cfg]
    capture prefill packed batch=[1, 2] tokens=[64] unguided
    combine mixed = prefill + decode {
        cap 8
        capture packed batch=[8] tokens=[64] guided
    }
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist
}
walk decode {
    loop decode_loop max=4 stop {
        LLM(text_inputs)
            -> new_token: client text
            -> text_inputs: LLM device
    }
}
walk probe {
    LLM(text_inputs) -> new_token: client text
}
partition P = prefill -> decode | probe
"""
CONFIG = "model: keyed\nmax_seq_len: 128\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return plan_of(tmp_path_factory.mktemp("keyed"), SPEC, CONFIG)


def _key(plan, walk):
    worker = plan.workers[0]
    return next(k for k in worker.keys if k.name == worker.walk_to_key[f"LLM/{walk}"])


def test_families_carry_their_guidance_mode_and_labels(plan):
    families = {f.name: f for k in plan.workers[0].keys for f in k.captures}
    assert {n: (f.guidance, f.labels) for n, f in families.items()} == {
        "LLM:decode": ("unguided", ["main"]),
        "LLM:decode#2": ("guided", ["main", "cfg"]),
        "LLM:prefill": ("unguided", ["main"]),  # not written: what its unguided steps touch
        "LLM:mixed": ("guided", ["main", "cfg"]),
    }
    # a guided decode row runs two sequences: the estimate counts its rows and tokens twice
    node = parse(SPEC, "keyed.mw", Diagnostics()).nodes[0]
    guided = node.captures[1]
    assert families["LLM:decode#2"].memory_bytes == estimate_family_bytes(node, guided, 1, num_sequences=2)
    assert estimate_family_bytes(node, guided, 1, num_sequences=2) > estimate_family_bytes(node, guided, 1)


def test_the_plan_rule_for_requiring_guidance(plan):
    rule = GuidanceRule.of(next(n for n in plan.nodes if n.name == "LLM"))
    assert rule.guided_walks == {"probe"}  # the walk that reads the guidance sequence
    assert rule.requires({}, ["prefill", "probe"])  # the default scale 2.0 is above 1
    assert not rule.requires({"cfg": 1.0}, ["prefill", "probe"])  # scale 1: no guidance
    assert not rule.requires({}, ["prefill", "decode"])  # its route reads no guidance sequence


def _batch(make, plan, rows):
    """rows: (request id, walk, tokens, requires guidance); one next_batch of a fresh scheduler."""
    scheduler = make(plan.workers[0], plan.deployment, lambda: 0.0)
    for request_id, walk, tokens, is_guided in rows:
        scheduler.add_ready_many([request_id], "LLM", walk, [tokens], guided=[is_guided])
    batch = scheduler.next_batch()
    assert batch is not None and len(batch.request_ids) == len(rows)
    return batch


@pytest.mark.parametrize("make", [WorkerScheduler, BaselineScheduler])
@pytest.mark.parametrize("rows, expected", [
    # decode steps: all rows unguided -> the unguided family; one guided row makes the step guided
    ([("a", "decode", 1, False), ("b", "decode", 1, False)], (False, "LLM:decode", 2)),
    ([("a", "decode", 1, False), ("b", "decode", 1, True), ("c", "decode", 1, False)], (True, "LLM:decode#2", 4)),
    ([("a", "decode", 1, True)], (True, "LLM:decode#2", 1)),
    # 5 rows: only the unguided family holds 5 rows; a guided step of 5 runs eagerly
    ([(f"r{i}", "decode", 1, False) for i in range(5)], (False, "LLM:decode", 8)),
    ([(f"r{i}", "decode", 1, i == 4) for i in range(5)], (True, None, 0)),
    # prefill is captured unguided only: a guided prefill step runs eagerly
    ([("a", "prefill", 10, False)], (False, "LLM:prefill", 1)),
    ([("a", "prefill", 10, True)], (True, None, 0)),
    # the combined walk's capture is guided only
    ([("a", "prefill", 10, False), ("b", "decode", 1, True)], (True, "LLM:mixed", 8)),
    ([("a", "prefill", 10, False), ("b", "decode", 1, False)], (False, None, 0)),
])
def test_a_step_replays_a_family_of_its_guidance_mode(plan, make, rows, expected):
    batch = _batch(make, plan, rows)
    assert (batch.is_guided, batch.capture, batch.padded_batch) == expected


def _step(plan, walk, capture, padded, is_guided, num_rows=1, mask=None):
    key = _key(plan, walk)
    mask = mask if mask is not None else 1 << key.walks.index(walk)
    entry = key.mixtures[mask]
    rows = [StepRow(f"r{i}", walk, 1, 4) for i in range(num_rows)]
    return Step(worker=0, key=key.name, node="LLM", mask=mask, label=entry.label, rows=rows,
                attention=entry.attention, capture=capture, padded_batch=padded, is_guided=is_guided)


def test_the_step_contract_refuses_a_family_of_the_other_mode(plan):
    checker = StepChecker(plan)
    checker.check(_step(plan, "decode", "LLM:decode", 1, is_guided=False))
    checker.check(_step(plan, "decode", "LLM:decode#2", 1, is_guided=True))
    checker.check(_step(plan, "decode", None, 0, is_guided=True))  # eager: either mode
    with pytest.raises(StepContractError, match="capture LLM:decode#2 serves guided steps, and this step is unguided"):
        checker.check(_step(plan, "decode", "LLM:decode#2", 1, is_guided=False))
    with pytest.raises(StepContractError, match="capture LLM:decode serves unguided steps, and this step is guided"):
        checker.check(_step(plan, "decode", "LLM:decode", 1, is_guided=True))


def test_the_step_contract_checks_the_mode_against_the_rows(plan):
    checker = StepChecker(plan)
    guided = {"r1"}
    step = _step(plan, "decode", "LLM:decode", 2, is_guided=False, num_rows=2)
    with pytest.raises(StepContractError, match="is_guided False, but request r1 requires guidance on LLM"):
        checker.check_mode(step, lambda request_id, node: request_id in guided)
    step = _step(plan, "decode", "LLM:decode#2", 2, is_guided=True, num_rows=2)
    checker.check_mode(step, lambda request_id, node: request_id in guided)
    with pytest.raises(StepContractError, match="is_guided True, but no row's request requires guidance"):
        checker.check_mode(step, lambda request_id, node: False)


def test_a_guided_step_on_a_node_without_guidance_is_refused(tmp_path):
    spec = """model plain
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out new_token: tokens
    capture prefill packed batch=[1, 2] tokens=[64]
}
walk prefill {
    LLM(text_inputs) -> new_token: client text
}
partition P = prefill
"""
    plain = plan_of(tmp_path, spec, CONFIG.replace("keyed", "plain"))
    key = plain.workers[0].keys[0]
    step = Step(worker=0, key=key.name, node="LLM", mask=1, label="prefill", rows=[StepRow("r", "prefill", 3, 0)],
                attention=key.mixtures[1].attention, capture="LLM:prefill", padded_batch=1, token_bucket=64,
                is_guided=True)
    with pytest.raises(StepContractError, match="a guided step of node LLM, which has no guidance sequences"):
        StepChecker(plain).check(step)
    assert key.captures[0].guidance == "any" and key.captures[0].labels == ["main"]


def test_a_guided_step_that_loses_its_guided_rows_runs_unguided(plan):
    key = _key(plan, "decode")
    step = _step(plan, "decode", "LLM:decode#2", 2, is_guided=True, num_rows=2)
    recompose(key, step, lambda request_id, node: False)
    assert (step.is_guided, step.capture, step.padded_batch) == (False, None, 0)
    step = _step(plan, "decode", "LLM:decode#2", 2, is_guided=True, num_rows=2)
    recompose(key, step, lambda request_id, node: request_id == "r1")
    assert (step.is_guided, step.capture) == (True, "LLM:decode#2")


def test_mixed_guidance_requests_run_with_the_captures_of_their_mode(plan):
    """Requests whose route takes `probe` (which reads the guidance sequence) are guided: the steps
    holding one of them are guided, and the engine checks every step's mode against its rows."""
    engine = TorchEngine(plan)
    steps = []
    launch = engine.launch

    def spy(step):
        steps.append((step.key, step.is_guided, step.capture, sorted(row.request_id for row in step.rows)))
        return launch(step)
    engine.launch = spy
    requests = [Request(id="g", prompt_tokens=[4, 5], max_tokens=4, route={"P": ["prefill", "probe"]})]
    requests += [Request(id=f"u{i}", prompt_tokens=[1, 2, 3 + i], max_tokens=4) for i in range(3)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    assert all(r.finish_reason in ("stop", "length", "done") for r in driver.conductor.records.values())
    keyed = {k.name for k in plan.workers[0].keys if any(f.guidance != "any" for f in k.captures)}
    for key, is_guided, capture, request_ids in steps:
        # the mode matters (and is set) only on keys whose captures are keyed by it
        assert is_guided == (key in keyed and "g" in request_ids)
        if capture is not None:
            family = next(f for k in plan.workers[0].keys for f in k.captures if f.name == capture)
            assert family.guidance in ("any", "guided" if is_guided else "unguided")
    assert any(is_guided for _, is_guided, _, _ in steps) and any(c == "LLM:decode" for _, _, c, _ in steps)
    # the guided request's first prefill step has no unguided family to replay: eager
    assert steps[0][1:3] == (True, None) and "g" in steps[0][3]


def test_the_guidance_batching_rule_groups_rows_by_the_same_rule():
    """`batching ... same guidance` compares the guidance sequences in use, none for a request that
    does not require guidance on the node, so a step of one class is of one guidance mode (and a
    Cosmos3 request without an explicit route through a generation walk is unguided)."""
    plan = generated("cosmos3")
    conductor = Conductor(plan, SimEngine(plan), lambda: 0.0)
    route = {"Cosmos": ["prefill", "image_gen"]}
    for request in (Request(id="routed", prompt_tokens=[1], max_tokens=1, route=route),
                    Request(id="scaled_down", prompt_tokens=[1], max_tokens=1, route=route, guidance={"uncond": 1.0}),
                    Request(id="default", prompt_tokens=[1], max_tokens=1)):
        conductor.submit(request)
    ids = ["routed", "scaled_down", "default"]
    classes = batch_classes(conductor, "dit", "image_gen", ids, [240] * 3, ("shape", "guidance"))
    assert classes == [(240, frozenset({"uncond"})), (240, frozenset()), (240, frozenset())]
    assert [conductor.requires_guidance(rid, "dit") for rid in ids] == [True, False, False]
