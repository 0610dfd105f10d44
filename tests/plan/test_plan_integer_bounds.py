"""The integer fields of a plan that size something at load or at the start of a run (a table, a
loop, an allocation) are held to mstarc's bounds when the plan loads (mstar/plan/int_bounds.py).

Each case is a plan edited by hand with its content hash recomputed, which before the bounds loaded
and then: built a tuple of `layers` entries in the simulated engine (out of memory), a frame of
`depth` + 1 tokens a step for a depth model (the simulated engine grew it until memory ran out), a
recurrent state of `num_slots` slots or a whisper decoder's position table of the pool's
`max_seq_len` in the torch engine (internal errors), ran a loop of 10**12 iterations (the run never
ended), or stalled every request (a step token budget, a chunk size below 1). Nothing here builds
what the edit asks for: the refusals are checked on the tables, and the one `mstar run` of a
formerly endless plan runs in a subprocess under `ulimit -v` and a timeout."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mstar.compiler import check_combine, check_graph, resolve
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse
from mstar.plan import int_bounds
from mstar.plan.io import PlanError, dump_plan, load_plan
from mstar.plan.references import reference_problems
from plan_files import (
    edited_plan as _edited, plan_key as _key, plan_node as _node, plan_walk as _walk, written_beside_its_sources,
)

ROOT = Path(__file__).resolve().parents[2]
BIG = 10**12


def _family(data, key, name):
    return next(c for c in _key(data, key)["captures"] if c["name"] == name)


def _pool(data):
    return data["deployment"]["kv_pools"][0]


def _loop_runs(walk, iterations, count):
    def edit(data):
        _walk(data, walk)["loops"][0].update(max_iters=iterations, default_count=count)
    return edit


# (plan, edit, words of the problem it must name)
REFUSED = {
    "layers": ("llama", lambda d: _node(d, "LLM")["dims"].update(layers=BIG), "dims layers=1000000000000 is past 4096"),
    "hidden": ("llama", lambda d: _node(d, "LLM")["dims"].update(hidden=2**62), "dims hidden="),
    "layer_pattern_entry": ("qwen3_5", lambda d: _node(d, "LLM")["dims"].update(layer_pattern=[0, 0, 0, BIG]),
                            "dims layer_pattern="),
    "submodel_layers": ("qwen3_tts", lambda d: _node(d, "Talker")["submodels"][0]["dims"].update(layers=BIG),
                        "sub-model code_predictor: dims layers="),
    "depth": ("qwen3_tts", lambda d: _node(d, "Talker")["submodels"][0].update(depth=BIG),
              "depth model code_predictor has depth 1000000000000"),
    "depth_zero": ("qwen3_tts", lambda d: _node(d, "Talker")["submodels"][0].update(depth=0),
                   "depth model code_predictor has depth 0"),
    "num_slots": ("qwen3_5", lambda d: _node(d, "LLM")["recurrent"].update(num_slots=BIG), "recurrent num_slots"),
    "num_slots_sink_only": ("qwen3_5", lambda d: _node(d, "LLM")["recurrent"].update(num_slots=1),
                            "recurrent num_slots 1"),
    "recurrent_layers": ("qwen3_5", lambda d: _node(d, "LLM")["recurrent"].update(num_layers=2**63 - 1),
                         "recurrent num_layers"),
    "recurrent_key_dim": ("qwen3_5", lambda d: _node(d, "LLM")["recurrent"].update(key_dim=0), "recurrent key_dim 0"),
    "cross_kv_tokens": ("whisper", lambda d: _node(d, "decoder")["cross_kv"][0].update(num_tokens=0),
                        "cross_kv audio holds 0 tokens"),
    "loop_count": ("wan22", _loop_runs("video_gen", BIG, BIG), "run up to 1000000000000 iterations"),
    "loop_max": ("llama", lambda d: _walk(d, "decode")["loops"][0].update(max_iters=2**63 - 1), "past 1073741824"),
    "max_rounds": ("whisper", lambda d: next(p for p in d["partitions"] if p["repeat"])["repeat"].update(max_rounds=0),
                   "repeats at most 0 rounds"),
    "num_pages": ("llama", lambda d: _pool(d).update(num_pages=BIG), "num_pages 1000000000000 is past"),
    "page_size": ("llama", lambda d: _pool(d).update(page_size=2**62), "page_size 4611686018427387904 is past"),
    "host_pages": ("llama_chunked", lambda d: _pool(d).update(host_pages=-1), "host_pages -1"),
    # a whisper decoder's position table is the pool's max_seq_len long (10**12: 256 TB asked at start-up)
    "pool_max_seq_len": ("whisper", lambda d: _pool(d).update(max_seq_len=BIG),
                         "max_seq_len 1000000000000 is more than its"),
    "max_seq_len": ("llama", lambda d: d["deployment"].update(max_seq_len=0), "deployment max_seq_len 0"),
    "max_concurrent_requests": ("llama", lambda d: d["deployment"].update(max_concurrent_requests=BIG),
                                "max_concurrent_requests 1000000000000"),
    "follower_batches": ("llama", lambda d: d["deployment"].update(max_consecutive_follower_batches=0),
                         "max_consecutive_follower_batches 0"),
    "token_budget": ("llama_chunked", lambda d: _key(d, "LLM:mixed").update(token_budget=0), "token_budget 0"),
    "chunk_size": ("llama_chunked", lambda d: _key(d, "LLM:mixed")["chunk_sizes"].update(prefill=-1),
                   "chunk_sizes[prefill] is -1"),
    "chunk_context_scale": ("llama_chunked", lambda d: _key(d, "LLM:mixed").update(chunk_context_scale=0),
                            "chunk_context_scale 0"),
    "tokens_per_row": ("llama", lambda d: _family(d, "LLM:mixed", "LLM:decode").update(tokens_per_row=0),
                       "tokens_per_row 0"),
    "token_bucket": ("llama", lambda d: _family(d, "LLM:mixed", "LLM:mixed")["token_buckets"].append(BIG),
                     "token bucket 1000000000000"),
    "unroll_prompts": ("llama", lambda d: _family(d, "LLM:mixed", "LLM:decode").update(unroll_prompts=BIG),
                       "unroll_prompts 1000000000000"),
    "capture_memory": ("llama", lambda d: d["workers"][0].update(capture_memory_bytes=-1),
                       "capture_memory_bytes -1"),
    # a chunk is one step's input of its consumer; the SNAC runner pads the last to the window's size
    "stream_window": ("orpheus", lambda d: next(p for p in d["partitions"] if p["streams"])["streams"][0]["policy"]
                      .update(size=BIG), "its size 1000000000000 is past 1048576 items"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_size_past_mstarcs_bounds_is_refused_at_load(case, tmp_path):
    name, edit, words = REFUSED[case]
    plan = _edited(name, edit)
    started = time.monotonic()
    problems = reference_problems(plan)
    assert any(words in p for p in problems), problems
    path = tmp_path / f"{name}.plan"
    path.write_text(dump_plan(plan))
    with pytest.raises(PlanError, match="do not fit together") as refusal:
        load_plan(path, verify=False)
    assert words in str(refusal.value)
    assert time.monotonic() - started < 5


ACCEPTED = {
    "layers_at_bound": ("llama", lambda d: _node(d, "LLM")["dims"].update(layers=4096)),
    "dim_at_bound": ("llama", lambda d: _node(d, "LLM")["dims"].update(vocab=2**31 - 1)),
    "num_slots_at_bound": ("qwen3_5", lambda d: _node(d, "LLM")["recurrent"].update(num_slots=65537)),
    "depth_at_bound": ("qwen3_tts", lambda d: _node(d, "Talker")["submodels"][0].update(depth=4096)),
    "loop_at_bound": ("wan22", _loop_runs("video_gen", 2**30, 50)),
    "pages_at_bound": ("llama_chunked", lambda d: _pool(d).update(num_pages=2**31 - 1, host_pages=2**31 - 1,
                                                                  page_size=2**20)),
    "no_host_pages": ("llama_chunked", lambda d: _pool(d).update(host_pages=0)),
    "pool_max_seq_len_at_bound": ("llama", lambda d: _pool(d).update(max_seq_len=_pool(d)["num_pages"] * 16)),
    "max_concurrent_requests_at_bound": ("llama", lambda d: d["deployment"].update(max_concurrent_requests=65536)),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_a_size_at_mstarcs_bound_loads(case):
    name, edit = ACCEPTED[case]
    assert reference_problems(_edited(name, edit)) == []


@pytest.mark.parametrize("path", sorted((ROOT / "generated").glob("*.plan")), ids=lambda p: p.stem)
def test_every_generated_plan_is_within_the_bounds(path):
    plan = load_plan(path, verify=False)
    assert int_bounds.bound_problems(plan) == []


def _spec_diagnostics(depth: int) -> str:
    """The spec-level checks of a small spec whose depth model adds `depth` tokens to a client output
    (tests/checks/test_depth_frames_counted.py's: it warns MW126, counting the frames)."""
    text = f"""model m
node T kv(layers=2, kv_heads=2, qo_heads=4, vocab=64) {{
    in text_inputs: tokens prompt text
    out codes: tokens
    submodel predictor(layers=1, vocab=16) samples codes depth={depth} for speak
}}

walk speak {{
    T(text_inputs) -> codes: client text
}}

partition P = speak
"""
    diags = Diagnostics()
    spec = parse(text, "m.mw", diags)
    assert spec is not None, diags.render()
    for check in (resolve.run, check_graph.run, lambda s, d: check_combine.run(s, None, d)):
        if not diags.has_errors:
            check(spec, diags)
    return diags.render()


def test_mstarc_refuses_a_depth_the_loader_refuses():
    """A depth model of depth=10**12 compiled (only MW126 warned) and the simulated engine then built
    a frame of 10**12 + 1 tokens a step; mstarc's MW125 now holds depth to the loader's bound."""
    assert "MW125" not in _spec_diagnostics(4096)
    rendered = _spec_diagnostics(BIG)
    assert "error[MW125]" in rendered and "depth=1000000000000 is more than the runtime builds" in rendered


def test_mstar_run_refuses_a_loop_of_10_12_iterations_at_once(tmp_path):
    """wan22 with a loop max and default count of 10**12 loaded, and `mstar run` never ended: now
    a one-line error before the run. A subprocess, bounded in memory and time as if the plan ran."""
    plan = _edited("wan22", _loop_runs("video_gen", BIG, BIG))
    path = written_beside_its_sources(plan, "wan22", tmp_path)
    command = (f"ulimit -v 4000000; exec timeout 60 {sys.executable} -m mstar.cli.mstar run --plan {path} "
               "--engine sim --requests 2 --no-progress")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, timeout=90,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "run up to 1000000000000 iterations" in done.stderr
    assert done.stderr.strip().startswith("mstar: error: plan"), done.stderr


def test_recurrent_state_slots_past_the_machine_are_a_start_up_refusal():
    """The torch engine allocated the recurrent state unguarded: a size no machine holds was an
    internal error. 2**62 slots overflow torch's size computation before any allocation."""
    from mstar.runtime.engine.models.gdn import LinearStates, LinearStatesError

    with pytest.raises(LinearStatesError, match="cannot allocate the recurrent state of 4611686018427387904 slots"):
        LinearStates.zeros(num_layers=1, num_slots=2**62, conv_dim=4, conv_kernel=4, num_heads=1, key_dim=4,
                           value_dim=4)
