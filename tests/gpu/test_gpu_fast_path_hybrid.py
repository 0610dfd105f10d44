"""The GPU fast path for a Qwen3.5 hybrid decoder on a CUDA GPU: fla-core's chunked gated delta
rule (prompt rows), the decode step's one fused kernel, the in-place recurrent kernel of an eager
step's decode rows and the conv of eager steps (`gdn_kernels.py`) against the torch arithmetic of
the same module and against the CPU fp32 reference layer (bf16 tolerance); decode graphs (the
rows' slots updated in place) against the eager step; greedy tokens against the CPU reference;
the prompt rule's graphs (`rule_graphs.py`) against fla called in every layer; piecewise graphs of
packed steps against the same steps run eagerly; and the qwen3_5
plan at spec dims on its decode graphs, with and without running ahead (two copies
of each state slot); the fused kernel's parts and their arrival counters over many layers and
steps. Skipped without a GPU (and, for the kernel checks, without fla-core)."""
import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_plans import LLM_DIMS, generate, held_row_tokens, llm_plan  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.plan.schema import RecurrentState  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu.device_model import build_decoder  # noqa: E402
from mstar.runtime.engine.gpu.executor import PackedFamilies, StepExecutor  # noqa: E402
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv  # noqa: E402
from mstar.runtime.engine.gpu.gdn_forward import GdnForward, LinearStep, fla_kernels, linear_layout  # noqa: E402
from mstar.runtime.engine.gpu.packing import RowSpec, pack  # noqa: E402
from mstar.runtime.engine.models.gdn import GatedDeltaNet, LinearStates  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"
NUM_SLOTS = 9
# FlashInfer's head dim (64) and fla's usual 128-wide key and value heads, grouped values (2 -> 4).
HYBRID_DIMS = dict(LLM_DIMS, head_dim=64, hidden=256, qo_heads=8, kv_heads=2, intermediate=512, layers=4,
                   layer_pattern=[0, 0, 0, 1], linear_value_heads=4)
RECURRENT = RecurrentState(num_layers=3, num_heads=2, key_dim=128, value_dim=128, num_slots=NUM_SLOTS)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float().cpu() - expected.float().cpu()).norm() / expected.float().cpu().norm()).item()


def _needs_fla():
    if fla_kernels(torch.device("cuda")) is None:
        pytest.skip("needs fla-core (pip install -e '.[gpu]')")


# ------------------------------------------------------------------ one layer: fla against torch


def _decode_layer(num_heads: int, num_value_heads: int):
    """A random layer (bf16 on the GPU, decay parameters fp32) and its fp32 CPU twin."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden=256, num_heads=num_heads, key_dim=128, value_dim=128, conv_kernel=4, eps=1e-6,
                          num_value_heads=num_value_heads)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.5 if param.dim() < 2 else param[0].numel() ** -0.5)
    gpu = copy.deepcopy(layer).to("cuda", torch.bfloat16)
    gpu.A_log = torch.nn.Parameter(layer.A_log.detach().cuda(), requires_grad=False)
    gpu.dt_bias = torch.nn.Parameter(layer.dt_bias.detach().cuda(), requires_grad=False)
    return layer, gpu


def _states(layer, device) -> LinearStates:
    states = LinearStates.zeros(1, NUM_SLOTS, layer.conv_dim, layer.conv_kernel, layer.num_value_heads,
                                layer.key_dim, layer.value_dim)
    generator = torch.Generator().manual_seed(1)
    states.conv[0].copy_(torch.randn(states.conv[0].shape, generator=generator) * 0.3)
    states.ssm[0].copy_(torch.randn(states.ssm[0].shape, generator=generator) * 0.05)
    return LinearStates([c.to(device) for c in states.conv], [s.to(device) for s in states.ssm])


@pytest.mark.parametrize("counts", [[1, 1, 1, 1, 1], [1, 70, 1, 5, 130, 1], [200]])
def test_fla_kernels_match_torch_and_the_reference(counts):
    """Decode-only, mixed (chunk boundaries crossed) and prompt-only rows on scattered slots."""
    _needs_fla()
    reference, layer = _decode_layer(2, 4)
    slots = [3, 7, 1, 5, 2, 6][:len(counts)]
    num_tokens = sum(counts)
    x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(2))
    bounds = [(s, s + c) for s, c in zip(np.cumsum([0] + counts[:-1]).tolist(), counts)]
    cpu_states = _states(reference, torch.device("cpu"))
    with torch.no_grad():
        expected = reference(x, bounds, slots, cpu_states.conv[0], cpu_states.ssm[0])
    results = []
    for use_fla in (True, False):
        states = _states(reference, torch.device("cuda"))
        forward = GdnForward([layer], states)
        assert forward.kernels is not None and forward.is_fused
        if not use_fla:  # fla's rule and the Triton conv off: torch ops throughout
            forward.kernels, forward.is_fused = None, False
        layout = linear_layout(np.array([0] + np.cumsum(counts).tolist()), 4)
        slot_tensor = torch.tensor(slots, device="cuda")
        step = (LinearStep.of(slot_tensor, states) if layout is None
                else layout.on_device(torch.from_numpy(layout.host).cuda(), slot_tensor, states))
        with torch.no_grad():
            out = forward(0, x.to("cuda", torch.bfloat16), step)
        torch.cuda.synchronize()
        results.append((out, states))
    (fla_out, fla_states), (torch_out, torch_states) = results
    assert _rel(fla_out, torch_out) < 2e-2
    assert _rel(fla_states.ssm[0], torch_states.ssm[0]) < 1e-2
    assert torch.equal(fla_states.conv[0], torch_states.conv[0])  # the stored windows: the same code on both
    assert _rel(fla_out, expected) < 3e-2
    assert _rel(fla_states.ssm[0], cpu_states.ssm[0]) < 2e-2
    assert _rel(fla_states.conv[0], cpu_states.conv[0]) < 1e-2


# ------------------------------------------------------------------ the decode step's one kernel


@pytest.mark.parametrize("num_heads, num_value_heads", [(4, 4), (2, 4)], ids=["heads", "grouped"])
def test_fused_decode_step_matches_torch_and_the_reference(num_heads, num_value_heads):
    """A decode-only step on the one fused kernel against the torch arithmetic on the GPU (bf16
    tolerance) and the CPU fp32 reference layer; two padding rows on slot 0 (the sink); slots of no
    row untouched; the value columns in parts of 32 (the default: an arrival counter, the last part
    norms the head) give what one part of all 128 gives (no counter)."""
    from mstar.runtime.engine.gpu import gdn_kernels

    reference, layer = _decode_layer(num_heads, num_value_heads)
    slots = [3, 7, 1]
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    cpu_states = _states(reference, torch.device("cpu"))
    with torch.no_grad():
        expected = reference(x[:3], [(i, i + 1) for i in range(3)], slots, cpu_states.conv[0], cpu_states.ssm[0])
    slot_tensor = torch.tensor(slots + [0, 0], device="cuda")
    results = []
    for is_fused in (True, False):
        states = _states(reference, torch.device("cuda"))
        forward = GdnForward([layer], states)
        forward.is_fused = is_fused
        with torch.no_grad():
            out = forward(0, x.to("cuda", torch.bfloat16), LinearStep.of(slot_tensor, states))[:3]
        torch.cuda.synchronize()
        results.append((out, states))
    (fused_out, fused_states), (torch_out, torch_states) = results
    assert _rel(fused_out, torch_out) < 2e-2
    assert _rel(fused_states.ssm[0][1:], torch_states.ssm[0][1:]) < 1e-2
    assert torch.equal(fused_states.conv[0][1:], torch_states.conv[0][1:])  # stored columns: copies of tokens
    assert _rel(fused_out, expected) < 3e-2
    assert _rel(fused_states.ssm[0][1:], cpu_states.ssm[0][1:]) < 2e-2
    untouched = _states(reference, torch.device("cuda"))
    for got, old in ((fused_states.conv[0], untouched.conv[0]), (fused_states.ssm[0], untouched.ssm[0])):
        for slot in (2, 4, 5, 6, 8):
            assert torch.equal(got[slot], old[slot])
    # The kernel alone, one part of all 128 value columns against parts of 32, from the same states.
    outputs = []
    for block_v in (128, 32):
        states = _states(reference, torch.device("cuda"))
        proj = GdnForward([layer], states).in_proj[0](x.to("cuda", torch.bfloat16))
        width = layer.num_value_heads * layer.value_dim
        mixed, z, b, a = proj.split([layer.conv_dim, width, layer.num_value_heads, layer.num_value_heads], dim=-1)
        outputs.append((gdn_kernels.decode_step(mixed, z, b, a, states.conv[0], layer.conv1d.weight[:, 0, :],
                                                layer.A_log, layer.dt_bias, states.ssm[0], slot_tensor,
                                                layer.norm.weight, layer.eps, num_heads, block_v=block_v)[:3],
                        states.ssm[0][1:].clone()))
    assert _rel(outputs[1][0], outputs[0][0]) < 1e-2
    assert _rel(outputs[1][1], outputs[0][1]) < 1e-3


@pytest.mark.parametrize("num_heads, num_value_heads, rows", [(16, 16, 62), (4, 8, 6)], ids=["qwen3_5", "grouped"])
def test_decode_step_parts_share_one_counts_over_layers_and_steps(num_heads, num_value_heads, rows):
    """The kernel's arrival counters under load: 4 layers x 25 steps of `rows` rows and two padding
    rows on the sink, all sharing one `counts` (as a decode graph's layers do; PDL as configured),
    in parts of 32 value columns against one part of all 128 (no counter): the counters end zero,
    the stored conv columns equal, states and outputs within fp32 / bf16 rounding."""
    from mstar.runtime.engine.gpu import gdn_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    taps, dim, layers, steps = 4, 128, 4, 25
    channels = 2 * num_heads * dim + num_value_heads * dim
    weight = (torch.randn(channels, taps, device="cuda", generator=gen) * 0.5).bfloat16()
    a_log = torch.randn(num_value_heads, device="cuda", generator=gen) * 0.5
    dt_bias = torch.randn(num_value_heads, device="cuda", generator=gen)
    norm_weight = torch.randn(dim, device="cuda", generator=gen).bfloat16()
    slots = torch.cat([torch.randperm(rows, generator=torch.Generator().manual_seed(1)) + 1,
                       torch.zeros(2, dtype=torch.long)]).cuda()
    conv0 = torch.randn(layers, rows + 1, channels, taps - 1, device="cuda", generator=gen)
    state0 = torch.randn(layers, rows + 1, num_value_heads, dim, dim, device="cuda", generator=gen) * 0.1
    results = []
    for block_v in (128, 32):
        conv, state = conv0.clone(), state0.clone()
        counts = torch.zeros((rows + 2) * num_heads, dtype=torch.int32, device="cuda")
        inputs = torch.Generator(device="cuda").manual_seed(2)
        outs = []
        for _ in range(steps):
            for layer in range(layers):
                proj = torch.randn(rows + 2, channels + num_value_heads * (dim + 2), device="cuda",
                                   generator=inputs).bfloat16()
                mixed, z, b, a = proj.split([channels, num_value_heads * dim, num_value_heads, num_value_heads], 1)
                outs.append(gdn_kernels.decode_step(mixed, z, b, a, conv[layer], weight, a_log, dt_bias, state[layer],
                                                    slots, norm_weight, 1e-6, num_heads, block_v=block_v,
                                                    counts=counts)[:rows])
        torch.cuda.synchronize()
        results.append((torch.stack(outs), conv[:, 1:], state[:, 1:], counts))
    (one_out, one_conv, one_state, _), (parts_out, parts_conv, parts_state, counts) = results
    assert not counts.any()
    assert torch.equal(parts_conv, one_conv)
    assert (parts_state - one_state).abs().max().item() < 1e-4
    assert _rel(parts_out, one_out) < 1e-2


def test_decode_rows_of_a_mixed_step_compute_as_in_a_decode_only_step():
    """The same decode rows (inputs, slots, states) in a decode-only step (the fused kernel) and in
    an eager mixed step beside a prompt (the eager conv and rule kernels, torch gates and norm):
    outputs and the rows' slots agree within bf16 rounding, the stored windows exactly."""
    reference, layer = _decode_layer(2, 4)
    x = torch.randn(72, 256, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    decode_slots = torch.tensor([3, 7], device="cuda")
    results = []
    for counts, slots in (([1, 1], [3, 7]), ([1, 70, 1], [3, 5, 7])):
        states = _states(reference, torch.device("cuda"))
        forward = GdnForward([layer], states)
        layout = linear_layout(np.array([0] + np.cumsum(counts).tolist()), 4)
        slot_tensor = torch.tensor(slots, device="cuda")
        rows = x[:2] if layout is None else torch.cat([x[:1], x[2:72], x[1:2]])
        step = (LinearStep.of(slot_tensor, states) if layout is None
                else layout.on_device(torch.from_numpy(layout.host).cuda(), slot_tensor, states))
        with torch.no_grad():
            out = forward(0, rows, step)
        decode_out = out if layout is None else out[[0, 71]]
        torch.cuda.synchronize()
        results.append((decode_out, states.conv[0][decode_slots], states.ssm[0][decode_slots]))
    (decode_out, decode_conv, decode_ssm), (mixed_out, mixed_conv, mixed_ssm) = results
    assert _rel(mixed_out, decode_out) < 2e-2
    assert torch.equal(mixed_conv, decode_conv)
    assert _rel(mixed_ssm, decode_ssm) < 1e-2


# ------------------------------------------------------------------ the step: graphs against eager


def _executor(batch_sizes, num_pages=256, packed=None):
    """packed: the executor's packed families (`PackedFamilies`), None for none."""
    plan = llm_plan(HYBRID_DIMS, recurrent=RECURRENT)
    dims = decoder_dims(plan.nodes[0], "spec")
    device = torch.device("cuda")
    model = build_decoder(dims, device, torch.bfloat16, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, num_pages, 16, dims.num_kv_heads, dims.head_dim, torch.bfloat16, device)
    kv.data.normal_()
    states = LinearStates.for_dims(dims, NUM_SLOTS, device)
    for tensor in states.conv + states.ssm:
        tensor.normal_(0, 0.05)
    pad = [0] + [min([b for b in batch_sizes if b >= n], default=0) for n in range(1, max(batch_sizes) + 1)]
    forward = DecoderForward(model, dims, kv, 4097, states)
    return StepExecutor(forward, kv, device, num_pages + 1, pad, is_flashinfer=True, packed=packed), states


def _snapshot(states: LinearStates) -> list[torch.Tensor]:
    return [t.clone() for t in states.conv + states.ssm]


def _restore(states: LinearStates, saved: list[torch.Tensor]) -> None:
    for tensor, value in zip(states.conv + states.ssm, saved):
        tensor.copy_(value)


def test_hybrid_decode_graph_replay_matches_the_eager_step():
    executor, states = _executor([1, 2, 4, 8])
    executor.capture()
    rows = [RowSpec([3 + i], 40 + 9 * i, list(range(4 * i, 4 * i + 4)), 1 + 2 * i) for i in range(3)]  # pads to 4
    before = _snapshot(states)
    with torch.no_grad():
        eager = executor._run_eager(pack(rows, 16, executor.kv.dummy_page))[0][:3].clone()
    eager_states = _snapshot(states)
    _restore(states, before)
    pending = executor.launch(rows)
    tokens = executor.collect(pending)
    assert pending.is_graph
    graphed = executor.graphs.logits[4][:3]
    assert _rel(graphed, eager) < 2e-2
    assert tokens.tolist() == eager.argmax(-1).tolist()
    after = _snapshot(states)
    for got, expected, old in zip(after, eager_states, before):
        for slot in (1, 3, 5):  # the rows' slots moved as in the eager step
            assert _rel(got[slot], expected[slot]) < 1e-2
            assert not torch.equal(got[slot], old[slot])
        for slot in (2, 4, 6, 7, 8):  # slots of no row (padding wrote only the sink, slot 0)
            assert torch.equal(got[slot], old[slot])
    # The same graph on other slots: the captured gather and scatter follow the staged row slots.
    other = [RowSpec([9], 60, list(range(20, 24)), 2)]
    assert executor.collect(executor.launch(other)).shape == (1,)
    assert not torch.equal(states.ssm[0][2], after[len(states.conv)][2])


@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prompts"])
def test_hybrid_fused_kernels_match_the_torch_ops(is_decode):
    """The hybrid step with every fused Triton kernel (the full layers' q/k norms inside RoPE and the
    gated output; the gated delta-net decode kernel or the eager step's kernels) against the same
    step in torch ops (bf16, eager, fla's chunk kernel off): logits, KV pages, the rows' slots."""
    executor, states = _executor([1, 2, 4])
    forward, gdn = executor.forward, executor.forward.gdn
    if is_decode:
        rows = [RowSpec([3 + i], 40 + 9 * i, list(range(4 * i, 4 * i + 4)), 1 + 2 * i) for i in range(3)]
    else:
        rows = [RowSpec([3, 5, 8 + i], 9 * i, list(range(4 * i, 4 * i + 4)), 1 + 2 * i) for i in range(3)]
    before, cache = _snapshot(states), executor.kv.data.clone()
    kernels, results = gdn.kernels, []
    for is_fused in (True, False):
        _restore(states, before)
        executor.kv.data.copy_(cache)
        forward.is_fused, gdn.is_fused, gdn.kernels = is_fused, is_fused, None
        with torch.no_grad():
            logits = executor._run_eager(pack(rows, 16, executor.kv.dummy_page))[0][:3].clone()
        results.append((logits, executor.kv.data[:, :, :12].clone(), [t[[1, 3, 5]] for t in _snapshot(states)]))
    forward.is_fused, gdn.is_fused, gdn.kernels = True, True, kernels
    (fused, fused_cache, fused_slots), (plain, plain_cache, plain_slots) = results
    assert _rel(fused, plain) < 2e-2
    assert _rel(fused_cache, plain_cache) < 1e-2
    for got, expected in zip(fused_slots, plain_slots):  # later layers' inputs differ by bf16 rounding
        assert _rel(got, expected) < 2e-2


def test_hybrid_eager_mixed_step_with_fla_matches_torch():
    """A mixed eager step (decode rows beside prompts of 100 and 3 tokens): fla's kernels against
    the torch arithmetic in the same step."""
    _needs_fla()
    executor, states = _executor([1, 2, 4])
    rows = [RowSpec([5], 30, [0, 1], 1), RowSpec(list(range(100)), 0, list(range(2, 9)), 2),
            RowSpec([7], 17, [9, 10], 3), RowSpec([4, 8, 15], 0, [11], 4)]
    before = _snapshot(states)
    results = []
    gdn = executor.forward.gdn
    kernels = gdn.kernels
    for use_fla in (True, False):
        _restore(states, before)
        gdn.kernels, gdn.is_fused = (kernels, True) if use_fla else (None, False)
        with torch.no_grad():
            logits = executor._run_eager(pack(rows, 16, executor.kv.dummy_page))[0].clone()
        results.append((logits, _snapshot(states)))
    gdn.kernels, gdn.is_fused = kernels, True
    (fla_logits, fla_states), (torch_logits, torch_states) = results
    assert _rel(fla_logits, torch_logits) < 2e-2
    for got, expected in zip(fla_states, torch_states):
        assert _rel(got[1:5], expected[1:5]) < 2e-2


def _eager_step(executor, rows):
    with torch.no_grad():
        return executor._run_eager(pack(rows, 16, executor.kv.dummy_page))[0].clone()


@pytest.mark.parametrize("order", ["prompts, mixed, prompts", "mixed, prompts, mixed"])
def test_rule_graphs_replay_what_fla_computes(order):
    """Eager steps whose prompt rule is captured on the step's second linear layer and replayed by
    the later ones (`rule_graphs.py`): the same logits and states as fla called in every layer, over
    steps of two layouts in turn (each step captures its own graph in the shared pool)."""
    _needs_fla()
    executor, states = _executor([1, 2, 4])
    prompts = [RowSpec(list(range(100)), 0, list(range(2, 9)), 2), RowSpec([4, 8, 15], 0, [11], 4)]
    mixed = [RowSpec([5], 30, [0, 1], 1), RowSpec(list(range(40, 110)), 0, list(range(12, 17)), 3),
             RowSpec([7], 17, [9, 10], 5)]
    steps = [prompts if name == "prompts" else mixed for name in order.split(", ")]
    graphs = executor.forward.gdn.rule_graphs
    before = _snapshot(states)
    results = {}
    for graphed in (True, False):
        _restore(states, before)
        graphs.why_off = None if graphed else "off for the comparison"
        results[graphed] = [(_eager_step(executor, rows), _snapshot(states)) for rows in steps]
    graphs.why_off = None
    # 3 linear layers a step: a layout's first step runs fla in the first (its kernels' variant is
    # new), a capture and a replay in the second, a replay in the third; a later step of a variant fla
    # has run captures in the first and replays in all three (a capture again where an input read in
    # place moved: rule_graphs.py)
    assert graphs.num_captured >= len(steps) and graphs.num_replayed == 2 * len(steps) + 1
    for (graph_logits, graph_states), (fla_logits, fla_states) in zip(results[True], results[False]):
        assert torch.equal(graph_logits, fla_logits)
        for got, expected in zip(graph_states, fla_states):
            assert torch.equal(got, expected)


def test_rule_graphs_run_fla_once_a_kernel_variant_then_capture_on_a_steps_first_call():
    """Steps of one layout: fla runs as it is once (the first step's first layer: it tunes and
    compiles), every later call is captured or replayed, with the chunk indices the step computes
    (`rule_graphs.chunk_indices`, which match fla's own); the logits and states equal fla's in every
    layer, step after step."""
    _needs_fla()
    from fla.ops.utils import prepare_chunk_indices

    from mstar.runtime.engine.gpu.rule_graphs import chunk_indices

    for lengths in ([100, 3], [64], [1, 65, 128, 7]):
        cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu_cpu.cuda()
        assert torch.equal(chunk_indices(cu_cpu, cu), prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu_cpu))
    executor, states = _executor([1, 2, 4])
    gdn = executor.forward.gdn
    fla, eager_calls = gdn.kernels, []

    def counted(*args, **kwargs):
        if not torch.cuda.is_current_stream_capturing():
            eager_calls.append(1)
        return fla(*args, **kwargs)

    rows = [RowSpec(list(range(100)), 0, list(range(2, 9)), 2), RowSpec([4, 8, 15], 0, [11], 4)]
    before = _snapshot(states)
    results = {}
    for graphed in (True, False):
        _restore(states, before)
        gdn.rule_graphs.why_off = None if graphed else "off for the comparison"
        gdn.kernels = counted if graphed else fla
        results[graphed] = [(_eager_step(executor, rows), _snapshot(states)) for _ in range(3)]
    gdn.kernels, gdn.rule_graphs.why_off = fla, None
    assert len(eager_calls) == 1
    for (graph_logits, graph_states), (fla_logits, fla_states) in zip(results[True], results[False]):
        assert torch.equal(graph_logits, fla_logits)
        for got, expected in zip(graph_states, fla_states):
            assert torch.equal(got, expected)


def test_rule_graphs_read_fixed_inputs_in_place_and_copy_the_moved_ones():
    """Values that lie where they lay in the step's first call are read in place by its graph (no
    copy), with whatever they hold at each replay; a value that moves later is captured again and
    copied from then on. Every call gives what the kernel gives on its own values."""
    from mstar.runtime.engine.gpu.rule_graphs import PromptRuleGraphs, RuleCall, StepRule

    def kernel(q, k, v, g, beta, initial_state, **_options):
        return v * 2 + g.unsqueeze(-1) + q - k, initial_state + beta.sum()

    device = torch.device("cuda")
    conv = torch.empty(6, 3, 4, device=device)  # q, k and v in one buffer, as a step's conv output
    g, beta = torch.empty(6, 3, device=device), torch.empty(6, 3, device=device)
    states = torch.randn(4, 3, 4, 4, device=device)
    read, cu = torch.tensor([2], device=device), torch.tensor([0, 6], device=device)
    graphs, step = PromptRuleGraphs(), StepRule()
    held = []  # every k, and g from call 4 on, a new tensor each call, kept so none reuses an address
    for index in range(5):
        conv.normal_(), beta.normal_(), g.normal_()
        held.append(conv * 1)
        if index >= 3:
            held.append(torch.randn(6, 3, device=device))
        call = RuleCall(kernel, conv, held[-2 if index >= 3 else -1], conv, held[-1] if index >= 3 else g, beta,
                        states, read, cu, cu.cpu())
        expected = call.run()
        out, final = graphs(call, step)
        assert torch.allclose(out, expected[0]) and torch.allclose(final, expected[1])
    captured = step.captured
    assert graphs.num_captured == 2 and graphs.num_replayed == 4
    # the last graph reads q, v and beta in place and copies k (a new tensor each call) and the moved g
    assert [buffer is None for buffer in captured.buffers] == [True, False, True, False, True]


def test_rule_graphs_fall_back_to_the_kernel_when_a_capture_fails():
    """A kernel that cannot run under capture: the capture fails once, the graphs turn off with a
    warning, and every call (that one too) runs the kernel as it is, with its results."""
    from mstar.runtime.engine.gpu.rule_graphs import PromptRuleGraphs, RuleCall, StepRule

    def kernel(q, k, v, g, beta, initial_state, **_options):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this kernel syncs with the host")
        return v * 2, initial_state + 1

    device = torch.device("cuda")
    q = torch.randn(5, 2, 8, device=device)
    states = torch.randn(3, 2, 8, 8, device=device)
    cu = torch.tensor([0, 5], device=device)
    call = RuleCall(kernel, q, q, q, q[:, :, 0], q[:, :, 0], states, torch.tensor([1], device=device), cu, cu.cpu())
    graphs, step = PromptRuleGraphs(), StepRule()
    for _ in range(3):
        out, final = graphs(call, step)
        assert torch.equal(out, q.unsqueeze(0) * 2) and torch.equal(final, states[1:2] + 1)
    assert graphs.why_off.startswith("a capture failed") and graphs.num_captured == 0 and step.calls == 3
    # the device and the allocator are usable after the failed capture
    assert torch.equal((q + 1).cpu(), q.cpu() + 1)


def test_rule_graphs_leave_long_prompts_to_fla():
    """A step over `MAX_TOKENS` prompt tokens calls fla in every layer: no capture."""
    from mstar.runtime.engine.gpu.rule_graphs import MAX_TOKENS

    _needs_fla()
    executor, _ = _executor([1, 2, 4], num_pages=MAX_TOKENS // 16 + 8)
    graphs = executor.forward.gdn.rule_graphs
    tokens = MAX_TOKENS + 1
    _eager_step(executor, [RowSpec([i % 100 for i in range(tokens)], 0, list(range(tokens // 16 + 1)), 1)])
    assert graphs.num_captured == 0 and graphs.why_off is None


def test_hybrid_piecewise_steps_match_eager_steps():
    """A hybrid decoder's packed steps on piecewise graphs (each layer cut at its attention or at its
    gated delta-net middle, which runs between the pieces over the step's real tokens): the logits
    and the rows' states of the same steps run eagerly, over a mixed step and a prompt step of two
    buckets, the second reading the states the first wrote."""
    _needs_fla()
    family = "LLM:mixed"
    packed = PackedFamilies(frozenset({family}), [32, 64, 128], max_rows=8)
    executor, states = _executor([1, 2, 4], packed=packed)
    executor.capture()
    assert sorted(executor.piecewise.pieces) == [32, 64, 128]
    assert all(len(pieces) == HYBRID_DIMS["layers"] + 1 for pieces in executor.piecewise.pieces.values())
    first = [RowSpec([5], 30, [0, 1], 1), RowSpec(list(range(20)), 0, [2, 3], 2), RowSpec([7], 17, [9, 10], 3)]
    second = [RowSpec([8], 20, [2, 3], 2), RowSpec(list(range(40, 90)), 0, list(range(12, 16)), 4)]
    steps = [(first, 32), (second, 64)]
    before, kv_before = _snapshot(states), executor.kv.data.clone()
    runs = {}
    for is_graph in (False, True):
        _restore(states, before)
        executor.kv.data.copy_(kv_before)
        logits = []
        for rows, bucket in steps:
            if is_graph:
                executor.collect(executor.launch(rows, None, family, bucket))
                logits.append(executor.piecewise.logits[:len(rows)].clone())
            else:
                logits.append(_eager_step(executor, rows)[:len(rows)])
        runs[is_graph] = (logits, _snapshot(states))
    assert executor.num_piecewise_steps == 2
    (eager_logits, eager_states), (graph_logits, graph_states) = runs[False], runs[True]
    for eager, graphed in zip(eager_logits, graph_logits):
        assert _rel(graphed, eager) < 2e-2
    for got, expected in zip(graph_states, eager_states):
        assert _rel(got[1:5], expected[1:5]) < 2e-2


def test_hybrid_engine_follows_the_cpu_reference():
    """Greedy tokens of a small hybrid on the fast path (bf16, fla, FlashInfer) against the CPU
    fp32 path: the first tokens agree (later ones may drift with bf16 rounding)."""
    from mstar.runtime.engine.torch_engine import TorchEngine

    prompts = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [3, 1], "c": list(range(20, 90))}
    plan = llm_plan(HYBRID_DIMS, recurrent=RECURRENT)
    cpu = generate(TorchEngine(plan, dims="spec"), prompts, 4, start_every=1)
    engine = TorchEngine(plan, dims="spec", device="cuda", attention="flashinfer")
    gpu = generate(engine, prompts, 4, start_every=1)
    assert engine.attention_backends() == {"LLM": "device"}  # the fast path (a hand-built plan: no graphs)
    assert sum(cpu[r][0] == gpu[r][0] for r in prompts) >= 2, (cpu, gpu)


def test_qwen3_5_plan_runs_on_its_decode_graphs():
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "qwen3_5.plan"))
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=1024)
    runner = engine.runners["LLM"]
    assert engine.attention_backends() == {"LLM": "flashinfer+graphs"}
    assert runner.capture_bytes > 0 and runner.slots is not None
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3] * (1 + 20 * i), max_tokens=8,
                        temperature=0.7 if i % 2 else None, seed=i) for i in range(5)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    reasons = {r.finish_reason for r in driver.conductor.records.values()}
    assert reasons <= {"stop", "length", "done"}, reasons
    # prompts on the packed families' piecewise graphs (the linear layers' middles between the pieces)
    assert runner.executor.num_graph_steps > 0 and runner.executor.num_piecewise_steps > 0
    assert runner.slots.num_free_slots == runner.slots.num_slots - 1  # every slot back but the sink


def test_qwen3_5_runs_ahead_on_its_decode_graphs():
    """Running ahead (two copies of each state slot): every request ends as in a run without it,
    with as many tokens and the same first token (bf16 is not batch-invariant, and the two runs'
    steps may batch rows differently), most decode rows taken from steps launched ahead. A held
    row (a step launched ahead for it that nobody claimed, its request going on) gives exactly
    the tokens of the run that never launched that step: the same real steps, its state copy undone."""
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "qwen3_5.plan"))
    runs, held = {}, {}
    for run_ahead in (False, True):
        engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=1024, run_ahead=run_ahead)
        runner = engine.runners["LLM"]
        assert engine.caps.can_launch_ahead == run_ahead
        assert (runner.states.version is not None) == run_ahead
        requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3] * (1 + 7 * i), max_tokens=4 + 3 * i)
                    for i in range(6)]
        driver = Driver(plan, engine)
        driver.run(Workload(requests))
        runs[run_ahead] = {rid: (r.finish_reason, r.num_output_tokens, list(r.output_tokens)[:1])
                           for rid, r in driver.conductor.records.items()}
        if run_ahead:
            assert runner.num_claimed_rows > runner.num_ahead_rows // 2 > 0
        assert runner.slots.num_free_slots == runner.slots.num_slots - 1
        held[run_ahead] = held_row_tokens(engine, "prefill_text", run_ahead)
    assert runs[True] == runs[False]
    assert held[True] == held[False]
