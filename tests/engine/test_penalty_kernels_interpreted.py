"""The penalties' Triton kernels (`engine/gpu/penalty_kernels.py`) under the Triton interpreter on
the CPU, against the torch ops they replace (`penalties.penalise(is_fused=False)`): the same
logits bit for bit and the same table, over steps that add pairs (a token counted twice in one
update among them), empty rows for new requests and count the token of a step launched ahead."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from mstar.runtime.engine.gpu.penalties import PenaltyTable, penalise  # noqa: E402
from mstar.runtime.engine.sampling import SamplingParams  # noqa: E402

VOCAB = 5000  # (two column blocks of the penalising kernel)


@pytest.fixture
def interpreted():
    skip_unless_child("test_penalty_kernels_under_the_interpreter")


@parent_only
def test_penalty_kernels_under_the_interpreter():
    run_child(__file__, "2 passed")


def _requests():
    settings = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5), SamplingParams(frequency_penalty=-0.7),
                SamplingParams(repetition_penalty=0.9, presence_penalty=-1.0, frequency_penalty=0.25)]
    return [SimpleNamespace(request_id=f"r{i}", params=p, history={"LLM": [3, 9, 9, 4999, 17 * i]},
                            sampled={"LLM": [9, 4, 4, 4097 + i]}) for i, p in enumerate(settings)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_penalise_as_the_torch_ops_do(interpreted, dtype):
    generator = torch.Generator().manual_seed(0)
    tables = {fused: PenaltyTable(torch.device("cpu")) for fused in (True, False)}
    requests = {fused: _requests() for fused in (True, False)}
    loop_tokens = torch.tensor([7, 4097, 12, 9], dtype=torch.int32)
    for step in range(4):
        # rows of a wider buffer (strided), the penalised ones among unpenalised rows
        logits = (torch.randn(6, VOCAB + 8, generator=generator) * 3).to(dtype)[:, :VOCAB]
        got = {}
        for fused, table in tables.items():
            for request in requests[fused]:  # a step's new sample, twice the same token at step 2
                request.sampled["LLM"].extend([step + 1] * (2 if step == 2 else 1))
                request.history["LLM"].append(step + 1)
            if step == 3:  # the last request ends; a new one takes its row
                table.forget("r2")
                requests[fused][2] = SimpleNamespace(request_id="new", params=SamplingParams(repetition_penalty=2.0),
                                                     history={"LLM": [1, 2, 3]}, sampled={"LLM": []})
            rows = table.rows([(place, request, [40, 41] if place == 4 else [])
                               for place, request in zip((0, 2, 4), requests[fused])], "LLM",
                              [1, 3, 0] if step % 2 else None)
            got[fused] = penalise(logits, rows, table, loop_tokens, is_fused=fused)
        assert torch.equal(got[True], got[False]), step
        assert torch.equal(tables[True].counts, tables[False].counts)
        assert torch.equal(tables[True].seen, tables[False].seen)
    assert not torch.equal(got[True], logits.float())


TYPES = {"logits_ptr": "*bf16", "stride_row": "i64", "out_ptr": "*fp32", "stride_out": "i64", "counts_ptr": "*i32",
         "seen_ptr": "*u8", "index_ptr": "*i64", "factors_ptr": "*fp32", "loop_ptr": "*i32", "num_rows": "i32",
         "vocab": "i32"}


@parent_only
@pytest.mark.parametrize("is_launched_so", [True, False])
def test_the_rules_round_as_torch_does_on_the_gpu(is_launched_so):
    """Compiled for an sm_90 GPU (on the CPU) with the options `penalise_rows` launches it with, the
    rules' division rounds to nearest and no multiply is fused into the subtraction after it; with
    fusion on (Triton 3.9's default) a multiply-add appears, so the bit-for-bit comparisons need the
    option."""
    from interpreter_child import compiled_for_sm90
    from mstar.runtime.engine.gpu import penalty_kernels

    options = penalty_kernels.PENALISE_OPTIONS if is_launched_so else {"enable_fp_fusion": True}
    ptx = compiled_for_sm90(penalty_kernels._penalise_kernel, TYPES, {"BLOCK": 1024}, options).asm["ptx"]
    assert "div.rn.f32" in ptx
    assert ("fma." not in ptx) == is_launched_so
