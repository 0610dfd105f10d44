"""The run summary's figures against the raw step log and records (`serve/metrics.summarize`)."""
import numpy as np

from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.metrics import summarize
from mstar.runtime.serve.workload import generate

from runtime_plans import generated


def _run(plan_name, workload, **engine_kw):
    plan = generated(plan_name)
    driver = Driver(plan, SimEngine(plan, **engine_kw))
    driver.run(workload)
    return driver, summarize(driver.conductor.records.values(), driver.log, 0.0)


def _stopped_run(workload, num_steps: int) -> Driver:
    """llama on the sim, the run stopped after `num_steps` steps (as an interrupt stops it)."""
    plan = generated("llama")
    driver = Driver(plan, SimEngine(plan))
    steps = {"num": 0}

    def stop_there(launch):
        steps["num"] += 1
        if steps["num"] == num_steps:
            driver.stop()

    driver.on_step = stop_there
    driver.run(workload)
    return driver


def test_host_times_per_step_leave_out_tp_follower_copies():
    """A follower's copy is logged with no post-process, launch or wait time of its own: counted, it
    pulled the host's percentiles down (orpheus_tp2: p50 13.4 against 28.7 us)."""
    driver, summary = _run("orpheus_tp2", generate(16, prompt_len=(4, 20), output_len=(4, 12), seed=0))
    log = driver.log
    assert summary["num_follower_steps"] > 0
    for name, values in (("postprocess_us_per_step", log.post_s), ("launch_us_per_step", log.launch_s),
                         ("wait_us_per_step", log.wait_s)):
        leaders = [v for v, follows in zip(values, log.is_follower) if not follows]
        assert summary[name]["p50"] == np.percentile(leaders, 50) * 1e6
        assert summary[name]["mean"] == np.mean(leaders) * 1e6


def test_rows_held_out_of_memory_count_each_hold_and_the_requests_apart():
    """`num_oom_rows` counts every hold (a row retried in 8 steps, 8); `num_held_requests` the
    requests ever held."""
    driver, summary = _run("orpheus", generate(30, prompt_len=(4, 40), output_len=(1, 40), arrival="staggered",
                                               seed=0), num_pages=12)
    assert summary["num_oom_rows"] == sum(driver.log.num_held_rows) > summary["num_held_requests"] > 0
    assert summary["num_held_requests"] == len(driver.log.held_requests) <= 30


def test_output_tokens_are_the_finished_requests():
    """An interrupted run's unfinished requests are not in its outputs file; their tokens are not
    counted in its output tokens (nor in tokens/s over the finished requests' span)."""
    driver = _stopped_run(generate(12, prompt_len=(4, 20), output_len=(20, 40), concurrency=4, arrival="closed",
                                   seed=0), 60)
    records = list(driver.conductor.records.values())
    finished = [r for r in records if r.is_finished]
    assert 0 < len(finished) < len(records) and any(r.num_output_tokens for r in records if not r.is_finished)
    summary = summarize(records, driver.log, 0.0)
    assert summary["output_tokens"] == sum(r.num_output_tokens for r in finished)
    # so are its latencies: the report gave TTFT over requests outputs.jsonl does not hold
    assert any(r.first_token_s is not None for r in records if not r.is_finished)
    ttfts = [r.first_token_s - r.arrival_s for r in finished if r.first_token_s is not None]
    assert summary["ttft_ms"]["mean"] == np.mean(ttfts) * 1000.0


def test_a_step_that_ran_no_row_is_not_in_the_composition():
    """A step whose every row was short of KV pages ran none: counted, it pulled its key's mean rows
    below what ran (whisper's prefill 0.75 where every step that ran held one row)."""
    driver, summary = _run("orpheus", generate(30, prompt_len=(4, 40), output_len=(1, 40), arrival="staggered",
                                               seed=0), num_pages=12)
    log = driver.log
    empty = [key for key, rows, follows in zip(log.key, log.num_rows, log.is_follower) if not rows and not follows]
    assert empty  # (the tight pool's steps whose rows were all held)
    for key, entry in summary["step_composition"].items():
        ran = [rows for k, rows, follows in zip(log.key, log.num_rows, log.is_follower) if k == key and rows
               and not follows]
        assert entry["steps"] == len(ran) and entry["mean_rows"] == sum(ran) / len(ran)


def test_the_postprocess_time_leaves_out_the_callers_finish_callback():
    """mstar run's `on_finish` writes outputs.jsonl and media inside a step's post-process: with
    `--out` its p90 went from 160 to 420 us. The driver's figure is its own work."""
    import time

    plan = generated("llama")
    driver = Driver(plan, SimEngine(plan))
    driver.on_finish = lambda ended: time.sleep(0.01)
    driver.run(generate(8, prompt_len=(4, 8), output_len=(2, 4), concurrency=8, arrival="closed", seed=0))
    summary = summarize(driver.conductor.records.values(), driver.log, 0.0)
    assert summary["num_completed"] == 8 and max(driver.log.post_s) < 0.01  # (every finish slept 10 ms)


def test_a_run_with_nothing_finished_spans_its_steps():
    """Stopped before any request finished: its run time was a made-up 1e-9 s beside its steps; it
    is the run clock's span from the first arrival to the last step."""
    driver = _stopped_run(generate(4, prompt_len=(4, 20), output_len=(200, 200), concurrency=4, arrival="closed",
                                   seed=0), 20)
    records = list(driver.conductor.records.values())
    assert not any(r.is_finished for r in records)
    summary = summarize(records, driver.log, 0.0)
    assert summary["duration_s"] == max(driver.log.end_s) - min(r.arrival_s for r in records) > 0
    assert summary["requests_per_s"] == summary["tokens_per_s"] == 0.0


def test_a_walk_that_ran_is_never_shown_as_none_per_step():
    """One prefill row in 64 steps read "prefill 0.0" in the table (the JSON had 0.0156)."""
    from mstar.runtime.serve.metrics import _rows

    assert (_rows(0.0156), _rows(0.0), _rows(0.05), _rows(6.34)) == ("<0.1", "0.0", "0.1", "6.3")
