"""The prompt rule's graphs (`engine/gpu/rule_graphs.py`) off a CUDA device: every call runs the
kernel as it is (the graphs capture only CUDA tensors), with the arguments fla takes, and the step
counts its calls. The captures themselves are GPU tests (tests/gpu/test_gpu_fast_path_hybrid.py)."""
import torch

from mstar.runtime.engine.gpu.rule_graphs import PromptRuleGraphs, RuleCall, StepRule


def test_calls_off_the_gpu_run_the_kernel_each_time():
    seen = []

    def kernel(q, k, v, g, beta, initial_state, **options):
        seen.append((q.shape, initial_state.clone(), options))
        return v.clone(), initial_state + 1

    q = torch.randn(7, 2, 4)
    states = torch.arange(3 * 2 * 4 * 4, dtype=torch.float32).view(3, 2, 4, 4)
    read = torch.tensor([2, 0])
    cu = torch.tensor([0, 3, 7])
    call = RuleCall(kernel, q, q, q, q[:, :, 0], q[:, :, 0], states, read, cu, cu.clone())
    graphs, step = PromptRuleGraphs(), StepRule()
    for _ in range(3):
        out, final = graphs(call, step)
        assert torch.equal(out, q.unsqueeze(0)) and torch.equal(final, states[read] + 1)
    assert step.calls == 3 and step.captured is None and graphs.num_captured == 0 and graphs.why_off is None
    assert graphs.num_as_is == 3
    shape, initial, options = seen[0]
    assert shape == (1, 7, 2, 4) and torch.equal(initial, states[read])
    assert options["cu_seqlens"] is cu and options["output_final_state"] and options["use_qk_l2norm_in_kernel"]


def test_the_what_if_switch_starts_later_graphs_off(monkeypatch):
    """`set_enabled(False)` (`mstar bench engine --no-rule-graphs`): graphs built afterwards start off
    and say why; those built before keep capturing."""
    from mstar.runtime.engine.gpu import rule_graphs

    monkeypatch.setattr(rule_graphs, "_why_off", None)
    before = PromptRuleGraphs()
    rule_graphs.set_enabled(False)
    assert PromptRuleGraphs().why_off == "turned off (--no-rule-graphs)" and before.why_off is None
    rule_graphs.set_enabled(True)
    assert PromptRuleGraphs().why_off is None


def test_chunk_indices_are_each_rows_chunks_in_order():
    """`chunk_indices`: (row, chunk) for every chunk of 64 tokens of every row, rows in order, in the
    device tensor's dtype (what fla derives from `cu_seqlens`; tests/gpu compares them with fla's)."""
    from mstar.runtime.engine.gpu.rule_graphs import chunk_indices

    for lengths in ([100, 3], [64], [1, 65, 128, 7], [0, 5, 0], []):
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        expected = [(row, chunk) for row, length in enumerate(lengths) for chunk in range(-(-length // 64))]
        got = chunk_indices(torch.tensor(bounds, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
        assert got.dtype == torch.int32 and got.shape == (len(expected), 2)
        assert [tuple(pair) for pair in got.tolist()] == expected


def test_a_call_given_chunk_indices_passes_them_to_fla():
    seen = {}

    def kernel(q, k, v, g, beta, initial_state, **options):
        seen.update(options)
        return v, initial_state

    q, states = torch.randn(5, 2, 4), torch.zeros(2, 2, 4, 4)
    cu = torch.tensor([0, 5])
    chunks = torch.tensor([[0, 0]])
    RuleCall(kernel, q, q, q, q[:, :, 0], q[:, :, 0], states, torch.tensor([1]), cu, cu, chunks).run()
    assert seen["chunk_indices"] is chunks
