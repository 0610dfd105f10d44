"""`mstar bench lone`: a lone request's path on the host with the device stubbed. The shared prefix
is found cached by the 2nd and later requests (llama_chunked's prefix cache) and not with
`--no-shared-prefix`; the points come in the order a step passes them, the first token last; a
missing plan is a one-line error."""
import json

from mstar.runtime.serve import bench_lone

PATH = ["admitted", "step built", "engine launch", "waiting for the device", "tokens back", "first token"]


def run_json(capsys, *argv: str) -> dict:
    assert bench_lone.main(["--requests", "3", "--prefix-len", "64", "--rounds", "2", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_shared_prefix_is_found_cached_and_the_path_is_in_order(capsys):
    result = run_json(capsys)
    assert result["cached_tokens"] == [0, 64, 64]
    medians = dict(result["median_ms"])
    assert all(point in medians for point in PATH)
    assert [medians[point] for point in PATH] == sorted(medians[point] for point in PATH)
    assert [point for point, _ in result["median_ms"]][-1] == "first token"
    assert len(result["runs"]) == 2


def test_prefixes_of_their_own_find_nothing_cached(capsys):
    result = run_json(capsys, "--no-shared-prefix")
    assert result["cached_tokens"] == [0, 0, 0]
    assert result["shared_prefix"] is False and dict(result["median_ms"])["first token"] > 0


def test_a_missing_plan_is_one_line(capsys, tmp_path):
    assert bench_lone.main(["--plan", str(tmp_path / "none.plan")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mstar bench lone:") and "\n" not in err
