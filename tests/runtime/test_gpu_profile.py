"""`mstar run --gpu-profile`: the idle summary of a profiler trace (a synthetic one here; the GPU
run is in tests/gpu/) and the refusal where there is no GPU to trace."""
import json
import subprocess
import sys

from mstar.runtime.serve.gpu_profile import device_intervals, idle_summary, summary_line


def _trace(events):
    return {"traceEvents": [{"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": "k"} for cat, ts, dur in events]
            + [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 10_000, "name": "host"}]}


def test_overlapping_device_work_is_merged_and_host_events_are_not_device_work():
    trace = _trace([("kernel", 0, 10), ("gpu_memcpy", 5, 10), ("kernel", 40, 10), ("gpu_memset", 50, 5)])
    assert device_intervals(trace) == [(0.0, 15.0), (40.0, 55.0)]


def test_idle_is_the_span_less_the_busy_time(tmp_path):
    # 100 us of work, then a 100 us gap, four times over: half the span idle, each gap counted.
    events = [("kernel", 200 * i, 100) for i in range(4)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace(events)))
    summary = idle_summary(str(path))
    whole = summary["whole_run"]
    assert whole["span_ms"] == 0.7 and whole["busy_ms"] == 0.4
    assert abs(whole["idle_pct"] - 100 * 3 / 7) < 0.01
    assert whole["num_gaps_over_20us"] == 3 and whole["gaps_over_20us_ms"] == 0.3
    assert "idle" in summary_line(summary)


def test_a_trace_without_device_work_says_so(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace([])))
    assert "no device work" in summary_line(idle_summary(str(path)))


def test_gpu_profile_on_the_cpu_is_refused(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mstar.cli.mstar", "run", "--plan", "generated/llama.plan",
                             "--requests", "1", "--gpu-profile", str(tmp_path / "t.json"), "--no-progress"],
                            capture_output=True, text=True, cwd=__import__("pathlib").Path(__file__).parents[2])
    assert result.returncode == 1, result.stderr
    assert "--gpu-profile" in result.stderr and "cuda" in result.stderr and "Traceback" not in result.stderr


def test_idle_by_tenth_shows_where_the_device_waited(tmp_path):
    # Busy all through the first half, then one short kernel every 100 us.
    events = [("kernel", 0, 500)] + [("kernel", 500 + 100 * i, 10) for i in range(6)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace(events)))
    tenths = idle_summary(str(path))["idle_pct_by_tenth"]
    assert len(tenths) == 10 and tenths[:4] == [0.0] * 4 and min(tenths[6:]) > 50


def test_idle_splits_into_gaps_inside_one_launch_and_gaps_between_launches(tmp_path):
    # Two graph replays (launches 1 and 2), each three kernels 10 us apart, 100 us between the
    # replays: the 10 us gaps are the graphs' own node-to-node latency, the 100 us the host's.
    events = []
    for launch, origin in ((1, 0), (2, 300)):
        events += [{"ph": "X", "cat": "kernel", "ts": origin + 70 * i, "dur": 60, "name": "k",
                    "args": {"correlation": launch}} for i in range(3)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    whole = idle_summary(str(path))["whole_run"]
    span = 300 + 200
    assert abs(whole["idle_inside_launches_pct"] - 100 * 40 / span) < 0.01
    assert abs(whole["idle_between_launches_pct"] - 100 * 100 / span) < 0.01
    assert abs(whole["idle_pct"] - (whole["idle_inside_launches_pct"] + whole["idle_between_launches_pct"])) < 0.02
    assert whole["num_gaps_over_20us"] == 1
    assert "between launches" in summary_line(idle_summary(str(path)))


def test_a_trace_without_launch_ids_counts_every_gap_as_between_launches(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace([("kernel", 0, 10), ("kernel", 15, 10)])))
    whole = idle_summary(str(path))["whole_run"]
    assert whole["idle_inside_launches_pct"] == 0.0 and whole["idle_between_launches_pct"] == whole["idle_pct"]
