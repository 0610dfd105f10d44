"""Running ahead with a hybrid decoder (Qwen3.5: gated delta-net layers beside full attention) on
the CPU: each recurrent state slot keeps two copies (`LinearStates`, `versions=2`), a step reads
its rows' current copies and writes the others, and a step launched ahead that nobody claims is
undone by flipping its rows' current copies back. A run with it gives every request the tokens of
a run without it: staggered arrivals, sampled rows, stop tokens, rows held for memory (their
steps launched ahead unclaimed while their requests go on), prompts cut in chunks beside the
decode rows."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine_plans import chunked_plan, held_row_tokens
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu.gdn_forward import LinearStep
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
from mstar.runtime.engine.kv.slots import node_slot_pool
from mstar.runtime.engine.models.gdn import LinearStates
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine

PLAN = load_plan(Path(__file__).resolve().parents[2] / "generated" / "qwen3_5.plan", verify=False)


def _engine(can_run_ahead: bool, num_pages: int = 96, num_slots: int = 9, budget: int = 0
            ) -> tuple[TorchEngine, GpuDecoderRunner]:
    plan = chunked_plan(PLAN, "prefill_text", budget)
    return fast_path_engine(plan, num_pages, max_seq_len=4096, with_decode_family=False, can_run_ahead=can_run_ahead,
                            slots=node_slot_pool("LLM", num_slots, None))


def _requests(num: int, prompt_len: int = 4) -> list[Request]:
    # Different prompt and output lengths, staggered arrivals (rows join and stop mid-chain), every
    # third request sampled (seeded), every other one with stop tokens.
    return [Request(id=f"r{i}", prompt_tokens=[(7 * j + 3 * i) % 500 + 1 for j in range(2 + (i * prompt_len) % 9)],
                    max_tokens=3 + (5 * i) % 13, arrival_s=0.01 * i, temperature=0.9 if i % 3 == 1 else None,
                    seed=i, stop_tokens=list(range(0, 512, 19)) if i % 2 else [])
            for i in range(num)]


def _run(engine: TorchEngine, requests: list[Request], concurrency: int = 0) -> dict[str, tuple]:
    driver = Driver(engine.plan, engine)
    workload = Workload([dataclasses.replace(r) for r in requests], closed_concurrency=concurrency or None)
    driver.run(workload)
    return {rid: (r.finish_reason, [list(map(int, t)) if isinstance(t, list) else int(t) for t in r.output_tokens])
            for rid, r in driver.conductor.records.items()}


def _reverts(runner: GpuDecoderRunner) -> list[int]:
    """Counts the slots whose steps launched ahead were undone (`LinearStates.revert`)."""
    assert runner.states is not None
    reverted: list[int] = []
    revert = runner.states.revert

    def counted(slots):
        reverted.extend(slots)
        revert(slots)
    runner.states.revert = counted  # type: ignore[method-assign]
    return reverted


def test_a_hybrid_that_runs_ahead_keeps_two_copies_of_each_slot():
    _, ahead = _engine(True)
    _, alone = _engine(False)
    assert ahead.can_run_ahead and ahead.states is not None and ahead.states.version is not None
    assert ahead.states.ssm[0].shape[0] == 2 * ahead.states.num_slots == 18
    assert not alone.can_run_ahead and alone.states is not None and alone.states.version is None
    assert alone.states.ssm[0].shape[0] == alone.states.num_slots == 9


def test_running_ahead_gives_the_same_tokens_and_claims_most_rows():
    requests = _requests(7)
    expected = _run(_engine(False)[0], requests)
    engine, runner = _engine(True)
    got = _run(engine, requests)
    assert got == expected
    assert all(reason in ("stop", "length") for reason, _ in got.values()), got
    assert runner.num_ahead_rows > 0 and runner.num_claimed_rows >= runner.num_ahead_rows - len(requests)


def test_running_ahead_under_memory_pressure_loses_nothing():
    requests = _requests(9, prompt_len=5)
    expected = _run(_engine(False, num_pages=6)[0], requests, concurrency=5)
    engine, runner = _engine(True, num_pages=6)
    got = _run(engine, requests, concurrency=5)
    assert got == expected
    assert all(reason in ("stop", "length") for reason, _ in got.values()), got
    assert runner.pool.num_free_pages == 6


def _held_row_run(can_run_ahead: bool) -> tuple[list[list[int]], list[int]]:
    engine, runner = _engine(can_run_ahead)
    reverted = _reverts(runner)
    return held_row_tokens(engine, "prefill_text", can_run_ahead), reverted


def test_a_held_row_gets_its_state_back():
    """The step launched ahead moved a's state one token on; undone, a's next steps give the tokens
    of the run that never launched it."""
    expected, _ = _held_row_run(False)
    got, reverted = _held_row_run(True)
    assert len(reverted) == 1  # a's slot, flipped back
    assert got == expected


@pytest.mark.parametrize("budget", [3, 8])
def test_chunked_prompts_beside_rows_running_ahead(budget):
    requests = _requests(6, prompt_len=7)
    expected = _run(_engine(False, budget=budget)[0], requests, concurrency=4)
    engine, runner = _engine(True, budget=budget)
    got = _run(engine, requests, concurrency=4)
    assert got == expected
    assert runner.num_ahead_chunks > 0 and runner.num_claimed_chunks > 0


# ------------------------------------------------------------------ the two copies themselves


def test_a_step_reads_the_current_copy_writes_the_other_and_a_revert_undoes_the_flip():
    states = LinearStates.zeros(1, 5, 6, 4, 2, 3, 3, versions=2)
    assert states.num_slots == 5 and states.ssm[0].shape[0] == 10
    read, write = states.step_slots(torch.tensor([3, 1, 0, 0]))
    assert read.tolist() == [3, 1, 0, 0] and write.tolist() == [8, 6, 5, 5]
    assert states.version is not None and states.version[[1, 3]].tolist() == [1, 1]
    read, write = states.step_slots(torch.tensor([3]))
    assert read.tolist() == [8] and write.tolist() == [3]
    states.revert([3])
    assert states.step_slots(torch.tensor([3]))[0].tolist() == [8]  # the flip of the undone step only
    assert states.current(3) == 3 and states.current(1) == 6
    states.clear(1)
    assert states.current(1) == 1 and not states.ssm[0][1].any()


def test_one_version_updates_in_place():
    states = LinearStates.zeros(1, 5, 6, 4, 2, 3, 3)
    read, write = states.step_slots(torch.tensor([3, 1]))
    assert read.tolist() == write.tolist() == [3, 1] and states.version is None
    states.revert([3])  # nothing to undo
    assert states.current(3) == 3


def test_a_layer_with_two_copies_leaves_the_read_copy_as_it_was():
    """The torch path of a decode step and of an eager mixed step: the copies the step read are
    untouched, the copies it wrote hold what the in-place step leaves in the slot."""
    import numpy as np

    from mstar.runtime.engine.gpu.gdn_forward import GdnForward, linear_layout
    from mstar.runtime.engine.models.gdn import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden=32, num_heads=2, key_dim=8, value_dim=8, conv_kernel=4, eps=1e-6, num_value_heads=4)
    for counts in ([1, 1], [1, 5]):
        x = torch.randn(sum(counts), 32)
        results = []
        for versions in (1, 2):
            states = LinearStates.zeros(1, 4, layer.conv_dim, 4, 4, 8, 8, versions=versions)
            generator = torch.Generator().manual_seed(1)
            for tensor in states.conv + states.ssm:  # the copies read hold the same values in both runs
                tensor[:4] = torch.randn(tensor[:4].shape, generator=generator)
                tensor[4:] = float("nan")  # what the step writes over must not matter
            before = [tensor.clone() for tensor in states.conv + states.ssm]
            layout = linear_layout(np.array([0] + np.cumsum(counts).tolist()), 4)
            slots = torch.tensor([3, 1])
            step = (LinearStep.of(slots, states) if layout is None
                    else layout.on_device(torch.from_numpy(layout.host), slots, states))
            with torch.no_grad():
                out = GdnForward([layer], states)(0, x, step)
            results.append((out, states, before, step))
        (out_one, one, _, _), (out_two, two, before, step) = results
        torch.testing.assert_close(out_two, out_one)
        for got, old, in_place in zip(two.conv + two.ssm, before, one.conv + one.ssm):
            assert torch.equal(got[step.read], old[step.read])  # the copies read: untouched
            torch.testing.assert_close(got[step.write], in_place[slots])
