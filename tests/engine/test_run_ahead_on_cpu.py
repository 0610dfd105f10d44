"""Running ahead (gpu/runner.py `prelaunch`, the run loop's `launch_ahead`) on the CPU: the fast
path's runner launches the speculated decode step N+1 before N's tokens reach the host. A run with
it gives every request the same tokens as a run without it, while most decode rows take the
result of a step launched ahead; rows it launched for requests that stopped, or that the run loop
held, are dropped and their device loop-back token put back."""
from __future__ import annotations



from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine

from pathlib import Path

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"


def _engine(can_run_ahead: bool, num_pages: int = 96) -> TorchEngine:
    engine, _ = fast_path_engine(load_plan(PLAN, verify=False), num_pages, max_seq_len=4096,
                                 can_run_ahead=can_run_ahead)
    return engine


def _requests(num: int) -> list[Request]:
    # Different prompt and output lengths, and staggered arrivals: rows join and stop mid-chain.
    # Every third request samples (seeded): a step launched ahead must count the sample before it.
    return [Request(id=f"r{i}", prompt_tokens=[3 + i, 9, 4 + 2 * i, 7][: 2 + i % 3], max_tokens=3 + (5 * i) % 11,
                    arrival_s=0.0, temperature=0.9 if i % 3 == 1 else None, seed=i) for i in range(num)]


def _run(engine: TorchEngine, num: int) -> dict[str, tuple]:
    driver = Driver(engine.plan, engine)
    driver.run(Workload(_requests(num)))
    return {rid: (r.finish_reason, list(r.output_tokens)) for rid, r in driver.conductor.records.items()}


def test_running_ahead_gives_the_same_tokens_and_claims_most_rows():
    expected = _run(_engine(False), 7)
    engine = _engine(True)
    got = _run(engine, 7)
    assert got == expected
    runner = engine.runners["LLM"]
    assert runner.num_ahead_rows > 0
    # Every decode row after the first of a chain can be claimed; the rows launched for requests
    # that stopped are the ones left.
    assert runner.num_claimed_rows >= runner.num_ahead_rows - 7
    assert runner.num_claimed_rows > 0


def test_running_ahead_under_memory_pressure_loses_nothing():
    """A small pool: rows are held for memory and steps change shape; rows launched ahead for held
    rows are dropped, and their device token put back, so the tokens stay the reference's."""
    expected = _run(_engine(False, num_pages=6), 9)
    engine = _engine(True, num_pages=6)
    got = _run(engine, 9)
    assert got == expected
    assert all(reason in ("stop", "length") for reason, _ in got.values()), got
    assert engine.runners["LLM"].pool.num_free_pages == 6  # every page came back


def test_a_dropped_row_gets_its_loop_back_token_back():
    """Launch ahead for a row, then run a step without it: its token table entry is restored, so the
    row's next real decode step reads the token its request last sampled."""
    from mstar.runtime.step import Step, StepRow

    engine = _engine(True)
    runner = engine.runners["LLM"]
    engine.add_request("a", Request(id="a", prompt_tokens=[4, 5, 6], max_tokens=20))
    engine.add_request("b", Request(id="b", prompt_tokens=[8, 2], max_tokens=20))

    def step(walk: str, rows: list) -> Step:
        worker = engine.plan.workers[0]
        key = next(k for k in worker.keys if k.name == worker.walk_to_key[f"LLM/{walk}"])
        mask = next(m for m, entry in enumerate(key.mixtures) if entry and entry.walks == [walk])
        entry = key.mixtures[mask]
        return Step(0, key.name, "LLM", mask, entry.label, rows, entry.attention)

    first = engine.run_step(step("prefill", [StepRow("a", "prefill", 3, 0, {"text_inputs": [4, 5, 6]}),
                                             StepRow("b", "prefill", 2, 0, {"text_inputs": [8, 2]})]))
    assert all(row.error is None for row in first.rows), first.rows
    slot = runner._row_slots["a"]
    both = [StepRow("a", "decode", 1, 3, {}), StepRow("b", "decode", 1, 2, {})]
    engine.wait(engine.launch(step("decode", both)))
    # The run loop speculates a and b; then only b runs: a's entry must hold a's last token again.
    engine.launch_ahead(0, "LLM", [("a", "decode"), ("b", "decode")])
    assert runner.num_ahead_rows == 2
    token_a = engine.requests["a"].last_token["LLM"][0]
    result = engine.wait(engine.launch(step("decode", [StepRow("b", "decode", 1, 3, {})])))
    assert result.rows[0].error is None and runner.num_claimed_rows == 1
    assert int(runner.executor.loop_tokens[slot]) == token_a
