"""The launch probe (`engine/gpu/launch_probe.py`, `mstar bench engine --extra-launches N`) under the
Triton interpreter on the CPU: a fused decode step launches exactly N probe kernels more a layer and
computes the same logits, KV cache and recurrent states."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402
from launch_count import count_launches  # noqa: E402

from engine_plans import hybrid_plan, llm_plan  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu import decode_attention, gdn_kernels, kernels, launch_probe  # noqa: E402
from mstar.runtime.engine.gpu.device_model import build_decoder  # noqa: E402
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv, torch_attend  # noqa: E402
from mstar.runtime.engine.gpu.packing import RowSpec, pack  # noqa: E402
from mstar.runtime.engine.models.gdn import LinearStates  # noqa: E402


@pytest.fixture
def probing(monkeypatch):
    skip_unless_child("test_launch_probe_under_the_interpreter")
    monkeypatch.setattr(launch_probe, "_extra_launches", 0)
    return launch_probe


@parent_only
def test_launch_probe_under_the_interpreter():
    run_child(__file__, "3 passed")


def _decode_step(is_hybrid: bool):
    """A fused forward's decode step of two rows over random cached context -> (a call running it,
    the tensors it writes)."""
    dims = decoder_dims((hybrid_plan() if is_hybrid else llm_plan()).nodes[0], "spec")
    model = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, 16, 16, dims.num_kv_heads, dims.head_dim, torch.float32, torch.device("cpu"))
    kv.data.normal_(generator=torch.Generator().manual_seed(3))
    states = LinearStates.for_dims(dims, 4) if is_hybrid else None
    for tensor in (states.conv + states.ssm) if states is not None else []:
        tensor.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    forward = DecoderForward(model, dims, kv, 256, states)
    forward.is_fused = True
    if forward.gdn is not None:
        forward.gdn.is_fused = True
    packed = pack([RowSpec([3], 5, [0], 1), RowSpec(None, 2, [1], 2)], 16, kv.dummy_page)
    ids, positions, slots, src, last_index, row_slot = torch.from_numpy(packed.host).split(packed.field_sizes())
    attend = torch_attend(packed.qo_indptr.tolist(), packed.kv_indptr.tolist(), packed.kv_indices,
                          packed.last_page_len.tolist(), 16, dims.head_dim ** -0.5)

    def step() -> torch.Tensor:
        linear = forward.decode_step(row_slot)
        return forward(ids, positions, slots, last_index, attend, linear, fed=(src, torch.tensor([0, 4, 9])))

    written = [kv.data] + ((states.conv + states.ssm) if states is not None else [])
    return step, written, dims.num_layers


@pytest.mark.parametrize("is_hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_each_layer_launches_the_probe_kernels_and_the_step_computes_the_same(probing, is_hybrid):
    results = []
    for extra in (0, 2):
        probing.set_extra_launches(extra)
        step, written, num_layers = _decode_step(is_hybrid)
        launches = count_launches(step, [kernels, gdn_kernels, decode_attention, launch_probe])
        step, written, _ = _decode_step(is_hybrid)
        results.append((launches, step(), [t.clone() for t in written]))
    (plain, plain_logits, plain_written), (probed, probed_logits, probed_written) = results
    assert probed.pop("_probe_kernel") == 2 * num_layers
    assert probed.pop("aten.empty", 0) == plain.pop("aten.empty", 0)  # allocation: no launch counted
    assert {k: v for k, v in probed.items() if v} == {k: v for k, v in plain.items() if v}
    assert torch.equal(probed_logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(probed_written, plain_written))


def test_a_negative_count_is_refused(probing):
    with pytest.raises(ValueError, match="0 or more"):
        probing.set_extra_launches(-1)
    assert probing.extra_launches() == 0
