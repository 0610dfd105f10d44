"""Two places an engine's `RowResult.is_length` (a stop that was a limit: the node sampled the
request's max_tokens, step.row_stop) decides a request's finish reason, which the checked-in plans
do not reach, because there the conductor's own count gets to max_tokens first:

- the loop pass's fast kernel (conductor/loop_pass.py `_fast_row` -> `_end_of_shape` ->
  `_stop(run, call, result.is_length)`): every fast loop of generated/*.plan counts its tokens.
  Here a spec whose decode loop has a stop and whose partition counts another edge (the prefill's
  first token, `count_tokens`), so only the engine's is_length can say the decode was cut;
- Whisper's decoder runner (engine/runners/whisper.py `_result`): its transcript is counted, so the
  conductor ends a request at max_tokens by itself; the runner's own flags are read here, per row.
  In long form the runner's count (every token it sampled, the windows' start tokens and the tokens
  after a window's last complete segment included) runs ahead of the transcript's: a window the
  runner cut at max_tokens now leaves no audio (audio_left 0), so no window follows it. Before, the
  partition repeated while audio was left, and every later window, cut at its first rows, added a
  token or two of audio 30 s further on until the transcript's count reached max_tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_text import plan_of

from mstar.runtime.conductor import loop_pass
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from runtime_plans import generated

# ---------------------------------------------------------------- the loop pass's fast kernel

# The decode loop emits text to the client, but the partition counts only the prefill's token
# (`count_tokens` on first_token): its decode rows count nothing, so max_tokens never ends the
# partition and the decode loop (max=50) ends at the engine's stop alone.
SPEC = """model cut_fast
node LLM kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out first_token: tokens
    out new_token: tokens
}
walk prefill {
    LLM(text_inputs) -> first_token: client text count_tokens
}
walk decode {
    loop decode_loop max=50 stop {
        LLM(text_inputs)
            -> text_inputs: LLM device
            -> new_token: client text
    }
}
partition P = prefill -> decode
"""
CONFIG = "model: cut_fast\nmax_seq_len: 128\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def fast_plan(tmp_path_factory):
    plan = plan_of(tmp_path_factory.mktemp("cut_fast"), SPEC, CONFIG)
    decode = next(w for w in plan.walks if w.name == "decode")
    assert decode.calls[0].counted == [] and decode.calls[0].stop_loop is not None  # counts nothing, has a stop
    return plan


def run_fast(plan, engine_name: str, request: Request, monkeypatch, is_columnar: bool = True):
    """(the request's record, what each row that ended its decode in the fast kernel reported:
    (its call takes the fast kernel, is_stop, is_length))."""
    ends = []
    end_of_shape = loop_pass._end_of_shape

    def spied(conductor, ready, row, result, ps):
        ends.append((row.handle.step.is_fast, result.is_stop, result.is_length))
        end_of_shape(conductor, ready, row, result, ps)

    monkeypatch.setattr(loop_pass, "_end_of_shape", spied)
    engine = SimEngine(plan) if engine_name == "sim" else TorchEngine(plan, seed=0)
    driver = Driver(plan, engine)
    driver.conductor.is_columnar = is_columnar
    driver.run(Workload([request]))
    return driver.conductor.records[request.id], ends


@pytest.mark.parametrize("engine_name", ["sim", "torch"])
def test_the_fast_kernel_ends_a_decode_the_engine_cut_at_max_tokens_length(fast_plan, engine_name, monkeypatch):
    """max_tokens 5: the prefill samples 1 token, the decode 4 more, and the engine reports the 5th
    a stop that was a limit. The conductor counted 1 token (the prefill's), so only is_length,
    through the fast kernel's `_stop`, makes the request `length`; the row-by-row path agrees."""
    record, ends = run_fast(fast_plan, engine_name, Request(id="a", prompt_tokens=PROMPT, max_tokens=5), monkeypatch)
    assert ends == [(True, True, True)]  # one row, of a fast call, stopped at a limit
    assert record.num_output_tokens == 1 and len(record.emissions) == 5  # the decode's 4 counted nothing
    assert record.finish_reason == "length"
    by_row, ends = run_fast(fast_plan, engine_name, Request(id="a", prompt_tokens=PROMPT, max_tokens=5), monkeypatch,
                            is_columnar=False)
    assert ends == [] and by_row.finish_reason == "length" and len(by_row.emissions) == 5


def test_the_fast_kernel_ends_a_decode_the_model_stopped_stop(fast_plan, monkeypatch):
    """The control, on the torch engine: a stop token sampled before max_tokens (is_length False)
    ends the same decode loop through the same kernel, and the request `stop`; a stop token at the
    last allowed sample too (row_stop: the model's stop, no cut)."""
    record, _ = run_fast(fast_plan, "torch", Request(id="a", prompt_tokens=PROMPT, max_tokens=12), monkeypatch)
    tokens = [e.value[0] for e in record.emissions]
    assert len(tokens) == 12 and record.finish_reason == "length"
    # the first decode token (emission 0 is the prefill's) not sampled before
    index = next(i for i in range(1, len(tokens) - 1) if tokens[i] not in tokens[:i])
    for max_tokens in (12, index + 1):
        request = Request(id="a", prompt_tokens=PROMPT, max_tokens=max_tokens, stop_tokens=[tokens[index]])
        record, ends = run_fast(fast_plan, "torch", request, monkeypatch)
        assert ends == [(True, True, False)], max_tokens
        assert [e.value[0] for e in record.emissions] == tokens[:index + 1]
        assert record.finish_reason == "stop", max_tokens


# ---------------------------------------------------------------- Whisper's decoder runner


def whisper_rows(request: Request, max_seq_len: int = 448):
    """Runs `request` on the whisper plan (the torch engine at tiny dims, random weights; no audio:
    30 s of seeded noise, one window) with the decoder's sequence at most `max_seq_len` positions:
    (the request's record, (walk, is_stop, is_length) of each decoder row, in order)."""
    plan = generated("whisper")
    if max_seq_len != 448:
        pools = [p.model_copy(update={"max_seq_len": max_seq_len}) for p in plan.deployment.kv_pools]
        deployment = plan.deployment.model_copy(update={"max_seq_len": max_seq_len, "kv_pools": pools})
        plan = plan.model_copy(update={"deployment": deployment})
    engine = TorchEngine(plan, seed=0)
    assert engine.runners["decoder"].max_seq_len == max_seq_len
    rows = []
    wait = engine.wait

    def watched(handle):
        result = wait(handle)
        if handle.step.node == "decoder":
            walks = {row.request_id: row.walk for row in handle.step.rows}
            rows.extend((walks[r.request_id], r.is_stop, r.is_length) for r in result.rows)
        return result

    engine.wait = watched
    driver = Driver(plan, engine)
    driver.run(Workload([request]))
    return driver.conductor.records[request.id], rows


def test_whisper_reports_length_only_where_max_tokens_cut_the_window():
    """max_tokens 6: the decoder's 6th row (prefill's 1, decode's 5) is the cut, is_length; no
    row before it is a stop."""
    record, rows = whisper_rows(Request(id="a", prompt_tokens=[], max_tokens=6))
    assert rows == [("prefill", False, False)] + [("decode", False, False)] * 4 + [("decode", True, True)]
    assert record.finish_reason == "length" and record.num_output_tokens == 6


def test_whisper_reports_a_stop_token_no_cut_even_at_max_tokens():
    """A request stop token sampled at the 4th row ends the window a stop (is_length False), with
    max_tokens beyond it or at it (the stop token is the model's stop, step.row_stop)."""
    record, _ = whisper_rows(Request(id="a", prompt_tokens=[], max_tokens=8))
    stop = int(record.output_tokens[3])
    assert stop not in record.output_tokens[:3]
    for max_tokens in (8, 4):
        record, rows = whisper_rows(Request(id="a", prompt_tokens=[], max_tokens=max_tokens, stop_tokens=[stop]))
        assert rows == [("prefill", False, False)] + [("decode", False, False)] * 2 + [("decode", True, False)]
        assert len(record.output_tokens) == 4
        if max_tokens == 8:  # at 4 the conductor's own count reached max_tokens too: not the runner's flag
            assert record.finish_reason == "stop"


def long_clip() -> torch.Tensor:
    """65 s of 16 kHz audio (a tone and seeded noise): three 30 s windows when none is cut."""
    t = np.arange(16000 * 65) / 16000
    noise = np.random.default_rng(0).standard_normal(t.shape[0])
    return torch.from_numpy((0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * noise).astype(np.float32))


def test_whisper_reports_a_full_window_a_stop_not_a_cut():
    """A decoder of 12 positions and max_tokens 100: the window's sequence fills (its start
    sequence and 9 tokens) long before max_tokens, a stop that is no cut, so the request ends
    `stop` with the window's tokens."""
    record, rows = whisper_rows(Request(id="a", prompt_tokens=[], max_tokens=100), max_seq_len=12)
    assert rows[-1] == ("decode", True, False)
    assert all(not is_stop and not is_length for _, is_stop, is_length in rows[:-1])
    assert record.finish_reason == "stop" and record.num_output_tokens == len(rows) < 100


def windows(rows: list) -> list[list]:
    """The decoder rows per window (a window starts at its prefill row)."""
    out: list[list] = []
    for row in rows:
        if row[0] == "prefill":
            out.append([])
        out[-1].append(row[1:])
    return out


def test_whisper_goes_on_after_a_full_window_and_stops_after_a_cut_one():
    """65 s of audio, a decoder of 12 positions: each window's sequence fills after a few rows (no
    cut), and long-form decoding goes on to the next, three windows, `stop`. With max_tokens 15 the
    runner's 15th row (window 2's 4th) is the cut: no window follows it (before, a third window
    ran 2 more rows and added 2 tokens of audio past 60 s), and the request ends `length`."""
    record, rows = whisper_rows(Request(id="a", prompt_tokens=[], max_tokens=1000, media={"audio": long_clip()}),
                                max_seq_len=12)
    assert [len(w) for w in windows(rows)] == [11, 9, 9]  # the first window's start sequence is shorter
    assert all(w == [(False, False)] * (len(w) - 1) + [(True, False)] for w in windows(rows))
    assert record.finish_reason == "stop"
    record, rows = whisper_rows(Request(id="a", prompt_tokens=[], max_tokens=15, media={"audio": long_clip()}),
                                max_seq_len=12)
    assert windows(rows) == [[(False, False)] * 10 + [(True, False)], [(False, False)] * 3 + [(True, True)]]
    assert record.finish_reason == "length" and record.num_output_tokens < 15
