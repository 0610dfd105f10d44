"""The GPU fast path for a Qwen3.5 hybrid decoder (gated delta-net + full attention) on the CPU, in
fp32 with the torch stand-ins for fla's kernels: a layer of `gdn_forward` against the reference
`GatedDeltaNet` (decode-only, prompt-only and mixed rows, chunk lengths below and above the conv
width, grouped value heads), and the fast runner's greedy tokens against the reference runner's
in prompt-only, decode-only, mixed and chunked steps, with the on-device loop-back. fla's kernels,
the graphs and FlashInfer run in tests/gpu/test_gpu_fast_path_hybrid.py."""
import numpy as np
import pytest
import torch

from engine_plans import generate, llm_plan, LLM_DIMS, step
from mstar.plan.schema import RecurrentState
from mstar.runtime.engine.gpu.device_model import build_decoder, unsupported_reason
from mstar.runtime.engine.gpu.gdn_forward import GdnForward, LinearStep, linear_layout
from mstar.runtime.engine.kv.slots import SlotPool
from mstar.runtime.engine.models.gdn import GatedDeltaNet, LinearStates
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.step import StepRow
from fast_path_cpu import fast_path_engine

NUM_SLOTS = 9


def hybrid(value_heads: int = 4):
    """Tiny Qwen3.5: 3 gated delta-net layers + 1 full-attention layer, grouped value heads."""
    dims = dict(LLM_DIMS, layers=4, layer_pattern=[0, 0, 0, 1], linear_value_heads=value_heads)
    recurrent = RecurrentState(num_layers=3, num_heads=2, key_dim=16, value_dim=16, num_slots=NUM_SLOTS)
    return llm_plan(dims, recurrent=recurrent)


def fast_engine(plan, num_pages=64):
    """A CPU engine whose LLM runner is the fast path's, in fp32 with the reference's weights."""
    return fast_path_engine(plan, num_pages, max_seq_len=4096, with_decode_family=False,
                            slots=SlotPool("LLM", NUM_SLOTS))[0]


PROMPTS = {f"r{i}": [1 + i, 7, 3 + 2 * i, 11, 40, 9, 300, 2][: 1 + (3 * i) % 8] for i in range(6)}


def test_hybrid_is_on_the_fast_path_with_the_reference_weights():
    engine = TorchEngine(hybrid())
    dims = engine.runners["LLM"].dims
    assert dims.has_linear_layers and dims.style == "qwen3_5" and unsupported_reason(dims) is None
    model = build_decoder(dims, torch.device("cpu"), torch.bfloat16, position=0, seed=0)
    for (name, expected), (other, got) in zip(engine.runners["LLM"].model.named_parameters(),
                                              model.named_parameters()):
        assert name == other and torch.equal(expected.to(got.dtype), got), name
        if name.endswith(("A_log", "dt_bias")):
            assert got.dtype == torch.float32, name  # the decay is computed in fp32


@pytest.mark.parametrize("start_every", [0, 1, 2])
def test_fast_runner_follows_the_reference_greedy_tokens(start_every):
    """start_every 0: one prompt-only step then decode-only steps; 1 and 2: mixed steps."""
    plan = hybrid()
    expected = generate(TorchEngine(plan), PROMPTS, 8, start_every=start_every)
    assert len({tuple(t) for t in expected.values()}) == len(PROMPTS)  # the rows differ: a real check
    assert generate(fast_engine(plan), PROMPTS, 8, start_every=start_every) == expected


def test_fast_runner_without_grouped_values():
    plan = hybrid(value_heads=2)
    expected = generate(TorchEngine(plan), PROMPTS, 6, start_every=1)
    assert generate(fast_engine(plan), PROMPTS, 6, start_every=1) == expected


def _chunked_run(engine, is_device_loop_back: bool) -> list[int]:
    """Request a: a 9-token prompt in chunks of 2, 3, 4 (beside request b's decode rows), then decodes."""
    from mstar.runtime.conductor.request import Request

    prompt_a, prompt_b = [5, 17, 3, 99, 4, 8, 250, 6, 1], [12, 13, 14]
    engine.add_request("a", Request(id="a", prompt_tokens=prompt_a, max_tokens=6))
    engine.add_request("b", Request(id="b", prompt_tokens=prompt_b, max_tokens=8))
    tokens = {"a": [], "b": []}
    out = engine.run_step(step(engine.plan, "LLM", [StepRow("b", "prefill", 3, 0, {"text_inputs": prompt_b})]))
    tokens["b"].append(out.rows[0].outputs["new_token"][0])
    start = 0
    for size in (2, 3, 4):
        rows = [StepRow("a", "prefill", size, start, {"text_inputs": prompt_a}, chunk_start=start,
                        is_partial=start + size < len(prompt_a)),
                StepRow("b", "decode", 1, 0, {} if is_device_loop_back else {"text_inputs": [tokens["b"][-1]]})]
        out = engine.run_step(step(engine.plan, "LLM", rows))
        for row in out.rows:
            assert row.error is None, row.error
            if row.outputs:
                tokens[row.request_id].append(row.outputs["new_token"][0])
        start += size
    for _ in range(3):
        rows = [StepRow(rid, "decode", 1, 0, {} if is_device_loop_back else {"text_inputs": [tokens[rid][-1]]})
                for rid in ("a", "b")]
        out = engine.run_step(step(engine.plan, "LLM", rows))
        for row in out.rows:
            tokens[row.request_id].append(row.outputs["new_token"][0])
    return tokens["a"] + tokens["b"]


def test_chunked_prompt_beside_decode_rows_and_the_device_loop_back():
    plan = hybrid()
    workers = [w.model_copy(update={"keys": [k.model_copy(update={"chunk_sizes": {"prefill": 4}}) for k in w.keys]})
               for w in plan.workers]
    plan = plan.model_copy(update={"workers": workers})
    expected = _chunked_run(TorchEngine(plan), is_device_loop_back=False)
    assert _chunked_run(fast_engine(plan), is_device_loop_back=False) == expected
    assert _chunked_run(fast_engine(plan), is_device_loop_back=True) == expected


def test_a_slot_is_zeroed_for_the_next_request():
    """A finished request's slot, taken again, starts from zero history: same tokens as alone."""
    plan = hybrid()
    first = generate(fast_engine(plan), {"x": [3, 1, 4, 1, 5]}, 5)
    engine = fast_engine(plan)
    generate(engine, {"y": [9, 2, 6, 5, 3, 5, 8]}, 7)
    assert generate(engine, {"x": [3, 1, 4, 1, 5]}, 5) == first


# ------------------------------------------------------------------ one layer against the reference


def _layer(value_heads: int = 4) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden=32, num_heads=2, key_dim=8, value_dim=8, conv_kernel=4, eps=1e-6,
                          num_value_heads=value_heads)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.5 if param.dim() < 2 else param[0].numel() ** -0.5)
    return layer


def _states(layer: GatedDeltaNet, num_slots: int = 6) -> LinearStates:
    states = LinearStates.zeros(1, num_slots, layer.conv_dim, layer.conv_kernel, layer.num_value_heads,
                                layer.key_dim, layer.value_dim)
    torch.manual_seed(1)
    for tensor in (states.conv[0], states.ssm[0]):
        tensor.normal_(0, 0.3)
    return states


def _clone(states: LinearStates) -> LinearStates:
    return LinearStates([c.clone() for c in states.conv], [s.clone() for s in states.ssm])


@pytest.mark.parametrize("counts", [[1, 1, 1], [5], [2, 7, 1], [1, 3, 1, 9]])
def test_a_layer_equals_the_reference_in_any_mix_of_rows(counts):
    """Rows of these token counts on slots 4, 1, 5, 2 (stored history in every slot): the output
    and every slot's new conv window and state equal the reference's."""
    layer = _layer()
    slots = [4, 1, 5, 2][:len(counts)]
    reference = _states(layer)
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    x = torch.randn(start, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = layer(x, bounds, slots, reference.conv[0], reference.ssm[0])
        states = _clone(_states(layer))
        forward = GdnForward([layer], states)
        cu = np.array([0] + [end for _, end in bounds])
        layout = linear_layout(cu, layer.conv_kernel)
        if layout is None:
            step_rows = LinearStep.of(torch.tensor(slots), states)
        else:
            data = torch.from_numpy(layout.host)
            step_rows = layout.on_device(data, torch.tensor(slots), states)
        got = forward(0, x, step_rows)
    assert (layout is None) == all(c == 1 for c in counts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states.conv[0], reference.conv[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states.ssm[0], reference.ssm[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("counts", [[1, 1, 1], [5], [2, 7, 1]])
def test_a_layers_middle_into_a_given_buffer(counts):
    """`GdnForward.middle` (what a piecewise step runs between its pieces) into a given buffer of
    stale values: the same output and the same slots as into a new one, every token's row written."""
    layer = _layer()
    slots, cu = torch.tensor([4, 1, 5][:len(counts)]), np.cumsum([0] + counts)
    mixed = torch.randn(int(cu[-1]), layer.conv_dim, generator=torch.Generator().manual_seed(3))
    g = -torch.rand(int(cu[-1]), layer.num_value_heads)
    beta = torch.rand(int(cu[-1]), layer.num_value_heads)
    results = []
    for given in (False, True):
        states = _clone(_states(layer))
        forward = GdnForward([layer], states)
        layout = linear_layout(cu, layer.conv_kernel)
        step_rows = (LinearStep.of(slots, states) if layout is None
                     else layout.on_device(torch.from_numpy(layout.host), slots, states))
        out = torch.full((int(cu[-1]), layer.num_value_heads, layer.value_dim), float("nan")) if given else None
        with torch.no_grad():
            got = forward.middle(0, mixed, g, beta, step_rows, out)
        assert got is out or not given
        results.append((got, states))
    (fresh, fresh_states), (into, into_states) = results
    assert not into.isnan().any()
    torch.testing.assert_close(into, fresh, rtol=0, atol=0)
    assert torch.equal(into_states.ssm[0], fresh_states.ssm[0]) and torch.equal(into_states.conv[0],
                                                                                fresh_states.conv[0])


def test_padding_rows_touch_only_the_sink_slot():
    layer = _layer()
    states = _states(layer)
    before = _clone(states)
    x = torch.randn(4, 32)
    with torch.no_grad():
        GdnForward([layer], states)(0, x, LinearStep.of(torch.tensor([3, 0, 0, 0]), states))
    for slot in (1, 2, 4, 5):
        assert torch.equal(states.ssm[0][slot], before.ssm[0][slot])
        assert torch.equal(states.conv[0][slot], before.conv[0][slot])
    assert not torch.equal(states.ssm[0][3], before.ssm[0][3])


def test_layout_of_a_mixed_step():
    """Conv taps of a 1-token row read its stored columns; a 5-token row's last taps its own tokens."""
    layout = linear_layout(np.array([0, 1, 6]), 4)
    conv, state, dec_tok, dec_row, pre_tok, pre_cu, pre_row = np.split(layout.host, np.cumsum(layout.sizes)[:-1])
    conv = conv.reshape(6, 4)
    # columns: row 0's stored 0..2, row 1's stored 3..5, then the 6 tokens at 6..11
    assert conv[0].tolist() == [0, 1, 2, 6]
    assert conv[1].tolist() == [3, 4, 5, 7] and conv[5].tolist() == [8, 9, 10, 11]
    assert state.reshape(2, 3).tolist() == [[1, 2, 6], [9, 10, 11]]
    assert dec_tok.tolist() == [0] and dec_row.tolist() == [0]
    assert pre_tok.tolist() == [1, 2, 3, 4, 5] and pre_cu.tolist() == [0, 5] and pre_row.tolist() == [1]


def test_every_layer_of_a_step_hands_fla_the_same_host_cu_seqlens():
    """fla's index helpers (its chunk indices) cache by their arguments' identity: the prompt rows'
    host cu_seqlens is one tensor for the whole step, not a new one a layer (a recorder stands in
    for fla's chunk kernel, which needs a GPU)."""
    layers = [_layer(), _layer()]
    states = LinearStates([c for layer in layers for c in _states(layer).conv],
                          [s for layer in layers for s in _states(layer).ssm])
    seen = []

    def chunk_rule(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, **kwargs):
        seen.append(cu_seqlens_cpu)
        return torch.zeros_like(v), initial_state

    forward = GdnForward(layers, states)
    forward.kernels = chunk_rule
    layout = linear_layout(np.array([0, 1, 6, 9]), layers[0].conv_kernel)
    step_rows = layout.on_device(torch.from_numpy(layout.host), torch.tensor([4, 1, 5]), states)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for index in range(len(layers)):
            forward(index, x, step_rows)
    assert len(seen) == 2 and seen[0] is seen[1]
    assert seen[0].tolist() == [0, 5, 8] and seen[0].dtype == torch.int64
