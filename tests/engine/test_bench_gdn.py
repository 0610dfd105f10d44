"""`mstar bench gdn` (`engine/gpu/bench_gdn.py`) on the CPU: its shape from a plan, the bytes of
its floor, its table, its refusals, and its comparison of value-block widths, run under the Triton
interpreter (the timing itself needs a GPU: tests/gpu/test_bench_gdn_gpu.py)."""
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.runtime.engine.gpu import bench_gdn  # noqa: E402

GENERATED = Path(__file__).resolve().parents[2] / "generated"
SMALL = bench_gdn.GdnShape(num_layers=2, num_heads=2, num_value_heads=4, key_dim=16, value_dim=64, conv_kernel=4,
                           eps=1e-6)


@parent_only
def test_bench_gdn_under_the_interpreter():
    run_child(__file__, "8 passed")


@pytest.mark.parametrize("rows", [1, 3])
def test_value_widths_agree_with_the_kernels_own(rows):
    """Parts of 16 and 32 and one program a head over all 64 value columns against the kernel's own
    width, from the same states: outputs within bf16 rounding, states within fp32, conv windows
    equal, counters left zero; a state the reference did not start from shows as a difference."""
    skip_unless_child("test_bench_gdn_under_the_interpreter")
    call = bench_gdn.layer_calls(SMALL, rows, torch.device("cpu"))[0]
    differences = bench_gdn.compare(SMALL, call, [16, 32, 64], reference_block=32)
    for block_v, diff in differences.items():
        assert diff["max_out_diff"] < 2e-2 and diff["max_state_diff"] < 1e-5, (block_v, diff)
        assert diff["conv_equal"] and diff["counts_left_zero"], (block_v, diff)
    reference = bench_gdn.layer_calls(SMALL, rows, torch.device("cpu"))[0]
    call.layer["state"][1:] += 1.0  # from other states the outputs differ: the comparison can fail
    counts = torch.zeros(rows * SMALL.num_heads, dtype=torch.int32)
    assert (call.run(SMALL, 16, counts) - reference.run(SMALL, 32, counts)).abs().max() > 1e-2


def test_the_shape_comes_from_the_plans_recurrent_layers():
    node = next(n for n in load_plan(str(GENERATED / "qwen3_5.plan")).nodes if n.engine == "kv")
    shape = bench_gdn.shape_of(node)
    assert (shape.num_layers, shape.num_heads, shape.num_value_heads, shape.key_dim, shape.value_dim) == \
        (18, 16, 16, 128, 128)
    assert shape.conv_dim == 3 * 16 * 128
    # A row's layer call: 1 MiB of state and 18 KiB of conv window, each read and written, 12,320
    # bf16 inputs and 2,048 bf16 outputs.
    state, window = 16 * 128 * 128 * 4, 6144 * 3 * 4
    assert shape.bytes_per_row() == 2 * (state + window) + (6144 + 16 * 130) * 2 + 2048 * 2


def test_the_table_prints_every_row_and_variant():
    case = {"floor_us": 2.0, "kernel_us": 4.6, "128": {"us": 7.1, "over_kernel": 1.543, "max_out_diff": 7.8e-3,
                                                       "max_state_diff": 8.5e-6, "conv_equal": True}}
    result = {"shape": vars(bench_gdn.GdnShape(18, 16, 16, 128, 128, 4, 1e-6)), "value_block": 32, "copy_tb_s": 4.1,
              "device": "H200", "rows": {"1": case, "64": dict(case, kernel_us=52.5)}}
    lines = bench_gdn.table(result).splitlines()
    assert "18 calls in a CUDA graph" in lines[0] and "16 q/k heads" in lines[0] and len(lines) == 5
    assert "parts of 32 us" in lines[1] and "one a head us (ratio)" in lines[1]
    assert lines[2].split()[:4] == ["1", "2.00", "4.60", "2.30x"] and lines[2].endswith("7.10 (1.54x)")
    assert lines[3].split()[2] == "52.50"
    assert lines[4].endswith("128: 7.8e-03, 8.5e-06, True")


@pytest.mark.parametrize("argv, message", [
    (["--plan", str(GENERATED / "llama.plan")], "has no kv node with gated delta-net layers"),
    (["--node", "nope"], "has no node 'nope' with gated delta-net layers (those with: LLM)"),
    (["--plan", "missing.plan"], "does not exist"),
])
def test_refusals_say_why(argv, message, capsys):
    if "--node" in argv:
        argv = ["--plan", str(GENERATED / "qwen3_5.plan")] + argv
    assert bench_gdn.main(argv) == 1
    assert message in capsys.readouterr().err


@parent_only  # the interpreter's process counts the same cases with a GPU or without
@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_measures_nothing(capsys):
    assert bench_gdn.main(["--plan", str(GENERATED / "qwen3_5.plan")]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_blocks_must_be_powers_of_two(capsys):
    with pytest.raises(SystemExit):
        bench_gdn.main(["--blocks", "48"])
    assert "powers of two" in capsys.readouterr().err
