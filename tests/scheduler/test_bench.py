"""`mstar bench scheduler`: output shape only (no timing assertions)."""
import json

from mstar.runtime.serve import bench_scheduler


def test_bench_prints_one_json_object_with_every_scenario(capsys):
    assert bench_scheduler.main(["--json", "--iters", "5", "--warmup", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    for part in ("scenarios", "baseline"):
        assert set(result[part]) == set(bench_scheduler.SCENARIOS)
        for figures in result[part].values():
            assert set(figures) == {"p50_us", "p90_us"} and figures["p50_us"] > 0


def test_bench_prints_ratios_without_json(capsys):
    assert bench_scheduler.main(["--iters", "5", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and "decode_1024 / decode_64" in out
