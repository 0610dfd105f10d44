"""`mstar bench sampler` (`engine/gpu/bench_sampler.py`) on the CPU: every kind timed at every row
count with the torch ops, its table and JSON, its refusals (the Triton draws and their ratio need a
GPU: tests/gpu/test_sampling_kernels_gpu.py)."""
import json

import pytest

from mstar.cli.mstar import main
from mstar.runtime.engine.gpu import bench_sampler


def test_every_kind_is_timed_at_every_row_count(capsys):
    assert main(["bench", "sampler", "--device", "cpu", "--vocab", "300", "--rows", "1,3", "--iters", "2",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    # a line of progress a row count on stderr (the defaults took about a minute on the CPU without a word)
    assert err.splitlines() == ["mstar bench sampler: 1 rows (1/2)", "mstar bench sampler: 3 rows (2/2)"]
    assert result["vocab"] == 300 and not result["has_kernels"] and set(result["rows"]) == {"1", "3"}
    for case in result["rows"].values():
        assert case["greedy_us"] > 0
        assert all(case[kind]["torch_us"] > 0 and "fused_us" not in case[kind] for kind in bench_sampler.KINDS)
        assert case["penalise_torch_us"] > 0 and "penalise_us" not in case and case["logprobs_us"] > 0
    table = bench_sampler.table(result)
    assert "the torch ops alone were timed" in table
    # the torch ops' penalise figure once, named, not again as if a kernel's (it was printed twice)
    one = result["rows"]["1"]["penalise_torch_us"]
    assert f"1 rows {one:.1f} (torch ops) and" in table and f"(torch ops {one:.1f})" not in table


@pytest.mark.parametrize("argv, words", [(["--rows", "0"], "between 1 and 4096"), (["--vocab", "1"], "between 2 and"),
                                         (["--rows", ","], "comma-separated integers")])
def test_bad_arguments_are_refused(capsys, argv, words):
    with pytest.raises(SystemExit):
        main(["bench", "sampler", "--device", "cpu", *argv])
    assert words in capsys.readouterr().err
