"""The launch probe (`engine/gpu/launch_probe.py`, `mstar bench engine --extra-launches N`) under the
Triton interpreter on the CPU: a fused decode step launches exactly N probe kernels more a layer and
computes the same logits, KV cache and recurrent states."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402
from launch_count import count_launches  # noqa: E402

from engine_plans import hybrid_plan, llm_plan  # noqa: E402
from fused_steps import fused_forward, two_row_step  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu import decode_attention, gdn_kernels, kernels, launch_probe  # noqa: E402


@pytest.fixture
def probing(monkeypatch):
    skip_unless_child("test_launch_probe_under_the_interpreter")
    monkeypatch.setattr(launch_probe, "_extra_launches", 0)
    return launch_probe


@parent_only
def test_launch_probe_under_the_interpreter():
    run_child(__file__, "3 passed")


@pytest.mark.parametrize("is_hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_each_layer_launches_the_probe_kernels_and_the_step_computes_the_same(probing, is_hybrid):
    dims = decoder_dims((hybrid_plan() if is_hybrid else llm_plan()).nodes[0], "spec")

    def decode_step(extra: int):
        """(the launches of a decode step with `extra` probe kernels a layer, what the step gave)."""
        probing.set_extra_launches(extra)
        built = fused_forward(dims, is_hybrid, is_fused=True)
        launches = count_launches(lambda: two_row_step(*built, is_decode=True),
                                  [kernels, gdn_kernels, decode_attention, launch_probe])
        return launches, two_row_step(*built, is_decode=True)

    (plain, plain_step), (probed, probed_step) = decode_step(0), decode_step(2)
    assert probed.pop("_probe_kernel") == 2 * dims.num_layers
    assert probed.pop("aten.empty", 0) == plain.pop("aten.empty", 0)  # allocation: no launch counted
    assert {k: v for k, v in probed.items() if v} == {k: v for k, v in plain.items() if v}
    assert torch.equal(probed_step[0], plain_step[0])  # the logits
    assert torch.equal(probed_step[1], plain_step[1])  # the KV cache
    assert all(torch.equal(a, b) for a, b in zip(probed_step[2], plain_step[2]))  # the recurrent states


def test_a_negative_count_is_refused(probing):
    with pytest.raises(ValueError, match="0 or more"):
        probing.set_extra_launches(-1)
    assert probing.extra_launches() == 0
