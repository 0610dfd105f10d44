"""`mstar run --gpu-idle` (engine/gpu/step_events.py): the gaps between steps from their device
times (synthetic ones here; tests/gpu runs the events), and the refusal where there is no GPU."""
import subprocess
import sys
from pathlib import Path

from mstar.runtime.engine.gpu.step_events import idle_between, summary_line


def test_the_idle_time_is_the_sum_of_the_gaps_between_consecutive_steps():
    # steps of 2 ms back to back, but a 0.5 ms gap before the third and the seventh
    spans, t = [], 0.0
    for i in range(10):
        t += 0.5 if i in (2, 6) else 0.0
        spans.append((t, t + 2.0))
        t += 2.0
    summary = idle_between(spans)
    whole = summary["whole_run"]
    assert summary["num_steps"] == 10 and whole["span_ms"] == 21.0
    assert whole["idle_between_steps_ms"] == 1.0 and abs(whole["idle_between_steps_pct"] - 100 / 21) < 0.01
    assert whole["num_gaps_over_20us"] == 2 and whole["largest_gap_ms"] == 0.5
    middle = summary["middle_half"]  # 5.25 .. 15.75 ms: holds the gap before the seventh step only
    assert middle["idle_between_steps_ms"] == 0.5 and middle["num_gaps_over_20us"] == 1
    assert "between steps" in summary_line("LLM", summary)


def test_steps_that_overlap_on_the_device_leave_no_gap():
    summary = idle_between([(0.0, 2.0), (1.5, 3.0), (3.0, 4.0)])
    assert summary["whole_run"]["idle_between_steps_ms"] == 0.0


def test_gpu_idle_on_the_cpu_is_refused():
    result = subprocess.run([sys.executable, "-m", "mstar.cli.mstar", "run", "--plan", "generated/llama.plan",
                             "--requests", "1", "--gpu-idle", "--no-progress"],
                            capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 1, result.stderr
    assert "--gpu-idle" in result.stderr and "cuda" in result.stderr and "Traceback" not in result.stderr


def test_events_attach_to_the_device_fast_path_executors_only():
    from types import SimpleNamespace

    from mstar.runtime.engine.gpu.step_events import StepEvents, attach

    on_gpu, on_cpu = SimpleNamespace(is_cuda=True, step_events=None), SimpleNamespace(is_cuda=False, step_events=None)
    engine = SimpleNamespace(runners={"LLM": SimpleNamespace(executor=on_gpu), "Codec": SimpleNamespace(),
                                      "Small": SimpleNamespace(executor=on_cpu)})
    attached = attach(engine)
    assert list(attached) == ["LLM"] and isinstance(on_gpu.step_events, StepEvents)
    assert attached["LLM"] is on_gpu.step_events and on_cpu.step_events is None
