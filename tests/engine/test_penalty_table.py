"""`penalties.PenaltyTable`: the device rows of the penalised requests' sample counts and seen
masks, kept between steps and sent only what the host collected since, penalise a step exactly as
the CPU rules over each request's whole lists do (engine/sampling.py), whatever the steps: requests
joining, ending and their rows taken by others, lists replaced (read again whole), prompt chunks fed,
and the last sample still on the device (a step launched ahead: `pending`)."""
from types import SimpleNamespace

import torch
from hypothesis import given, strategies as st

from mstar.runtime.engine.gpu.penalties import PenaltyTable, penalise
from mstar.runtime.engine.sampling import SamplingParams, apply_output_penalties, apply_repetition_penalty

VOCAB = 23
NODE = "LLM"
SETTINGS = [SamplingParams(repetition_penalty=1.5), SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4)]
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=6)
# a step of one request: (which, its settings, fed tokens, its sample, whether that sample stays on
# the device to the next step, whether it ends after, whether its lists are replaced first)
row_steps = st.tuples(st.integers(0, 3), st.integers(0, len(SETTINGS) - 1), tokens, st.integers(0, VOCAB - 1),
                      st.booleans(), st.booleans(), st.booleans())


def expected(logits, requests, pending):
    """The CPU rules over each row's whole lists: seen = its history, this step's fed tokens and its
    samples; counts over its samples; the uncollected sample among both."""
    seen, outputs = [], []
    for (request, fed), late in zip(requests, pending):
        sampled = request.sampled.get(NODE, []) + late
        repeats = request.params.repetition_penalty != 1.0
        seen.append(torch.tensor(request.history.get(NODE, []) + list(fed) + sampled if repeats else sampled,
                                 dtype=torch.long))
        outputs.append(torch.tensor(sampled, dtype=torch.long))
    params = [request.params for request, _ in requests]
    logits = apply_repetition_penalty(logits, seen, torch.tensor([p.repetition_penalty for p in params]))
    return apply_output_penalties(logits, outputs, torch.tensor([p.presence_penalty for p in params]),
                                  torch.tensor([p.frequency_penalty for p in params]))


@given(st.lists(st.lists(row_steps, min_size=1, max_size=4, unique_by=lambda step: step[0]), max_size=10),
       st.integers(0, 2**31))
def test_the_table_penalises_as_the_whole_lists_do(steps, seed):
    table, live, loop_tokens = PenaltyTable(torch.device("cpu")), {}, torch.zeros(4, dtype=torch.int32)
    waiting: dict[int, int] = {}  # which -> its sample the host has not collected (in loop_tokens[which])
    generator = torch.Generator().manual_seed(seed)
    for step in steps:
        rows = []
        for which, setting, fed, sample, _, _, is_replaced in step:
            request = live.get(which)
            if request is None:
                request = live[which] = SimpleNamespace(request_id=f"r{which}-{len(rows)}-{id(step)}",
                                                        params=SETTINGS[setting], history={}, sampled={})
            if is_replaced:  # (a request's KV moved in: its lists are new ones, here as long as before)
                if which in waiting:
                    request.sampled[NODE].append(waiting.pop(which))
                request.history[NODE] = [sample] * len(request.history.get(NODE, []))
                request.sampled[NODE] = [sample] * len(request.sampled.get(NODE, []))
            rows.append((request, fed))
        is_ahead = all(which in waiting for which, *_ in step)  # (a step is launched ahead for all its rows)
        if not is_ahead:  # the host collects its rows' samples first
            for (which, *_), (request, _) in zip(step, rows):
                if which in waiting:
                    request.sampled[NODE].append(waiting.pop(which))
        pending = [[waiting[which]] if is_ahead else [] for which, *_ in step]
        logits = torch.randn(len(rows), VOCAB, generator=generator) * 3
        penalised = table.rows([(place, request, fed) for place, (request, fed) in enumerate(rows)], NODE,
                               [which for which, *_ in step] if is_ahead else None)
        got = penalise(logits.clone(), penalised, table, loop_tokens)
        assert torch.allclose(got, expected(logits, rows, pending), atol=1e-5)
        for (which, _, fed, sample, stays, ends, _), (request, _) in zip(step, rows):
            if which in waiting:  # collected now
                request.sampled[NODE].append(waiting.pop(which))
            request.history.setdefault(NODE, []).extend(fed)
            request.sampled.setdefault(NODE, [])
            if ends:
                table.forget(request.request_id)
                del live[which]
            elif stays:
                waiting[which] = sample
                loop_tokens[which] = sample
            else:
                request.sampled[NODE].append(sample)
