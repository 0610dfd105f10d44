"""`mstar bench kv` runs its scenarios and prints figures that hold together (the sim engine, small
sizes); a device or dims for the simulator is refused with a message, not ignored."""
import json

import pytest

from mstar.runtime.serve import bench_kv


def test_bench_kv_on_the_sim_gives_both_variants_and_the_prefix_figures(capsys):
    assert bench_kv.main(["--decode-rows", "4", "--prompt-len", "512", "--prefix-requests", "3",
                          "--prefix-len", "256", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["engine"] == "sim" and results["device"] == "cpu"
    chunked, whole = results["chunked"], results["whole"]
    assert chunked["token_budget"] and whole["token_budget"] is None
    assert chunked["ttft_ratio"] > 0 and whole["ttft_ratio"] > 0
    # The cache serves the whole shared prefix to every request after the first.
    assert results["prefix"]["cached_tokens"][1:] == [256, 256]
    assert results["prefix"]["ttft_ratio"] > 1


def test_a_device_for_the_simulator_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_kv.main(["--device", "cuda"])
    assert stop.value.code == 2
    assert "--engine torch" in capsys.readouterr().err


def test_the_route_what_if_changes_only_the_steps_that_mix_prompt_and_decode_rows(capsys):
    from mstar.plan.io import load_plan

    plan = load_plan("generated/llama_chunked.plan")
    split = bench_kv.with_route(plan, "split")
    before = [m.attention for w in plan.workers for k in w.keys for m in k.mixtures]
    after = [m.attention for w in split.workers for k in w.keys for m in k.mixtures]
    assert "packed" in before and "packed" not in after
    assert [a for a in before if a not in ("packed", "split")] == [a for a in after if a not in ("packed", "split")]
    assert bench_kv.main(["--decode-rows", "4", "--prompt-len", "512", "--scenario", "chunk", "--route", "split",
                          "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["route"] == "split"
    # the decode rows got tokens while the prompt prefilled, and the figures say how spread they were
    assert results["chunked"]["itl_p50_during_ms"] <= results["chunked"]["itl_max_during_ms"]
