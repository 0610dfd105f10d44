"""`mstar bench postprocess` runs and prints its figures (a command, not a timed test)."""
import json
from contextlib import nullcontext

import pytest

from mstar.cli.mstar import main

from runtime_plans import ROOT

SMALL = ["--plan", str(ROOT / "generated" / "llama.plan"), "--clients", "4", "--requests", "8",
         "--prompt-len", "5", "--output-len", "6", "--rounds", "1"]


def test_prints_every_variant_the_ratios_and_the_split(capsys):
    assert main(["bench", "postprocess", *SMALL]) == 0
    out = capsys.readouterr().out
    for variant in ("columnar", "steady", "general", "per-row"):
        assert f"{variant:<10} loop steps" in out
    assert "over columnar, loop steps p50: steady" in out and "general" in out and "per-row" in out
    assert "host time per step" in out


def test_json_has_per_step_and_per_row_figures(capsys):
    assert main(["bench", "postprocess", *SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    loop_steps = result["variants"]["columnar"]["loop_steps"]
    assert loop_steps["steps"] > 0 and loop_steps["p50_us"] > 0 and loop_steps["p50_us_per_row"] > 0
    assert set(result["variants"]["columnar"]["split_us_per_step"]) == {
        "scheduler", "step building", "engine call", "post-process", "run loop rest"}


@pytest.mark.parametrize("argv, fragment", [(["--rounds", "0"], "argument --rounds: must be between"),
                                            (["--plan", "/nonexistent.plan"], "does not exist")])
def test_bad_arguments_are_one_line_errors(capsys, argv, fragment):
    with pytest.raises(SystemExit) if "--rounds" in argv else nullcontext():
        status = main(["bench", "postprocess", *argv])
        assert status == 1
    assert fragment in capsys.readouterr().err



def test_bytecodes_counts_every_part_and_post_process_is_not_free(capsys):
    assert main(["bench", "postprocess", *SMALL, "--json", "--bytecodes"]) == 0
    per_row = json.loads(capsys.readouterr().out)["bytecodes_per_row"]
    assert set(per_row) == {"scheduler", "step building", "engine call", "post-process", "run loop rest"}
    # every part of the simulated run executes Python per row; a part counted as zero would mean
    # the tracer missed it
    assert all(per_row[part] > 0 for part in ("step building", "engine call", "post-process"))


def test_the_next_steps_speculation_is_the_schedulers_time(capsys, monkeypatch):
    """`cover.speculate`, called after each launch, picks the next step: it was counted in "run loop
    rest" (about 20 us a step), not "scheduler"."""
    import time

    from mstar.runtime.serve.speculation_cover import SpeculationCover

    speculate = SpeculationCover.speculate

    def slow(self, *args, **kwargs):
        time.sleep(0.002)
        return speculate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculationCover, "speculate", slow)
    assert main(["bench", "postprocess", *SMALL, "--json"]) == 0
    split = json.loads(capsys.readouterr().out)["variants"]["columnar"]["split_us_per_step"]
    assert split["scheduler"] > 1500 > split["run loop rest"]
