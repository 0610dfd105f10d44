"""`mstar bench kv --budgets B,B --chunk-rounds N`: every budget runs once a round, the order
reversed every other round, after a warm-up run of each not counted; each run the chunk scenario's
chunked variant (the same figures as a run of that budget alone, on the deterministic sim), and the
count of runs meeting both targets."""
import json

import pytest

from mstar.runtime.serve import bench_kv, bench_kv_sweep

SMALL = ["--decode-rows", "4", "--prompt-len", "512", "--scenario", "chunk", "--json"]


def test_the_rounds_alternate_the_budgets_order_and_count_the_runs_that_meet_both_targets():
    figures = {224: {"itl_p99_ratio": 1.9, "ttft_ratio": 1.2}, 192: {"itl_p99_ratio": 1.4, "ttft_ratio": 1.6}}
    ran: list = []

    def run_at(budget):
        ran.append(budget)
        return figures[budget] | {"num_decode_ended_in_window": 0}

    result = bench_kv_sweep.sweep([224, 192], 3, run_at)
    assert ran == [224, 192] + [224, 192, 192, 224, 224, 192]  # a warm-up run of each, not counted
    assert result["order"] == ["224", "192", "192", "224", "224", "192"]
    assert [run["round"] for run in result["budgets"]["224"]["runs"]] == [0, 1, 2]
    assert result["budgets"]["224"]["num_met"] == 3 and result["budgets"]["192"]["num_met"] == 0
    assert "both met in 3 of 3" in bench_kv_sweep.render(result)


def test_a_missing_ratio_never_meets_the_targets():
    assert not bench_kv_sweep.meets_both({"itl_p99_ratio": None, "ttft_ratio": 1.0})
    assert bench_kv_sweep.meets_both({"itl_p99_ratio": 2.0, "ttft_ratio": 1.5})


def test_each_run_of_the_sweep_is_the_chunked_run_of_its_budget(capsys):
    assert bench_kv.main(SMALL + ["--budgets", "160,96", "--chunk-rounds", "2"]) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert sweep["order"] == ["160", "96", "96", "160"]
    for budget in (160, 96):
        assert bench_kv.main(SMALL + ["--budget", str(budget), "--no-whole", "--no-flat"]) == 0
        alone = json.loads(capsys.readouterr().out)["chunked"]
        for run in sweep["budgets"][str(budget)]["runs"]:  # the sim is deterministic
            assert run["itl_p99_ratio"] == pytest.approx(alone["itl_p99_ratio"])
            assert run["ttft_ratio"] == pytest.approx(alone["ttft_ratio"])


def test_rounds_alone_sweep_the_given_budget(capsys):
    assert bench_kv.main(SMALL + ["--budget", "128", "--chunk-rounds", "2"]) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert sweep["order"] == ["128", "128"]


@pytest.mark.parametrize("argv, message", [(["--budgets", "160", "--budget", "96"], "not both"),
                                           (["--budgets", "0,96"], "between 1 and"),
                                           (["--budgets", ","], "comma-separated")])
def test_bad_budget_lists_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_kv.main(SMALL + argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
