"""`mstar bench engine`'s chunked-prefill steps on the CPU, with a stand-in executor: each context
is timed as the plan would run it (its mixed bucket and route), with the decode rows and the chunk
at that context. The device timings themselves need a GPU (tests/gpu)."""
from pathlib import Path

import torch

from mstar.plan.io import load_plan
from mstar.plan.dims import decoder_dims
from mstar.runtime.engine.gpu import bench

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"


class _StandIn:
    packed_graphs = None  # no whole graphs unless a test gives some

    def __init__(self, unroll_prompts: int = 0):
        self.launched = []
        self.unroll_prompts, self.num_unrolled_steps = unroll_prompts, 0

    def _split(self, specs, route):
        """As `StepExecutor._split`: decode rows (one token, looped back) first on the split route."""
        num_decode = sum(spec.is_decode and spec.num_tokens == 1 for spec in specs) if route == "split" else 0
        return None, num_decode if 0 < num_decode < len(specs) else 0

    def launch(self, specs, sampling, family, tokens, route, glue, scoring=()):
        self.launched.append(([(s.num_tokens, s.num_cached) for s in specs], family, tokens, route))
        if 1 < max(s.num_tokens for s in specs) <= self.unroll_prompts:  # as StepExecutor._unrolled
            self.num_unrolled_steps += 1

    def collect(self, pending):
        return None


def _bench_setup(monkeypatch, kernels: tuple[float, float]):
    """The llama plan's kv node, its shapes, a stand-in executor; no device sync, and `_kernel_ms`
    runs the step once and answers `kernels` (all, attention)."""
    plan = load_plan(PLAN)
    node = next(n for n in plan.nodes if n.engine == "kv")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_kernel_ms", lambda step, num_steps=5: (step(), kernels)[1])
    shapes = bench.Shapes(decoder_dims(node, "spec"), weight_bytes=2 * 10 ** 9, matmul_params=10 ** 9)
    return plan, node, shapes, _StandIn()


def test_each_chunk_context_is_timed_on_the_plans_mixed_bucket(monkeypatch):
    plan, node, shapes, executor = _bench_setup(monkeypatch, (2.0, 0.5))
    out: dict = {}
    bench._chunk_steps(out, plan, node, executor, 16, 4, shapes, 4e12, 7e14)
    assert list(out["chunk"]) == [str(c) for c in bench.CHUNK_CONTEXTS]
    expected_bucket = bench.packed_bucket(plan, node, [(1, bench.CONTEXT)] * 40 + [(216, 0)], True)
    for figures in out["chunk"].values():
        assert (figures["token_bucket"], figures["attention"]) == expected_bucket[1:]
        assert figures["kernels_ms"] == 2.0 and figures["attention_kernels_ms"] == 0.5
        # the floor grows with the context the chunk attends to
        assert figures["floor_ms"] > 0
    floors = [out["chunk"][str(c)]["floor_ms"] for c in bench.CHUNK_CONTEXTS]
    assert floors == sorted(floors) and floors[0] < floors[-1]
    for rows, family, tokens, route in executor.launched:
        assert rows[:40] == [(1, bench.CONTEXT)] * 40 and rows[40][0] == 216
        assert rows[40][1] in bench.CHUNK_CONTEXTS and (family, tokens, route) == expected_bucket


def test_the_prefix_tail_step_runs_on_the_plans_prefill_bucket(monkeypatch):
    """A cached request's first step: its 16 tokens after the 1024 cached, on the prefill bucket the
    plan gives it, with kernels and a floor that counts the cached context."""
    plan, node, shapes, executor = _bench_setup(monkeypatch, (1.5, 0.2))
    out: dict = {}
    bench._prefix_tail_step(out, plan, node, executor, 16, 4, shapes, 4e12, 7e14)
    expected = bench.packed_bucket(plan, node, [bench.PREFIX_TAIL], False)
    figures = out["prefix_tail"]
    assert figures["token_bucket"] == expected[1] and figures["kernels_ms"] == 1.5
    assert figures["floor_ms"] >= 2 * 10 ** 9 / 4e12 * 1e3  # at least the weights' read
    assert executor.launched and all(rows == [bench.PREFIX_TAIL] and (family, tokens, route) == expected
                                     for rows, family, tokens, route in executor.launched)
    table = bench._table({"device": "stand-in", "copy_bandwidth_tb_s": 4.0, "matmul_tflop_s": 700.0,
                          "decode": {}, "mixed_63_1": _case(), "prefill_1x512": _case(),
                          "prefill_16x1024": _case(), "prefix_tail": figures})
    assert "cached request's first step (16 tokens after 1024 cached): " in table


def test_an_unrolled_prefix_tail_step_is_timed_beside_the_same_step_not_unrolled(monkeypatch):
    plan, node, shapes, executor = _bench_setup(monkeypatch, (1.5, 0.2))
    executor.unroll_prompts = 16
    out: dict = {}
    bench._prefix_tail_step(out, plan, node, executor, 16, 4, shapes, 4e12, 7e14)
    figures = out["prefix_tail"]
    assert figures["unrolled"] and figures["not_unrolled"]["kernels_ms"] == 1.5
    assert executor.unroll_prompts == 16  # put back after the step not unrolled
    table = bench._table({"device": "stand-in", "copy_bandwidth_tb_s": 4.0, "matmul_tflop_s": 700.0,
                          "decode": {}, "mixed_63_1": _case(), "prefill_1x512": _case(),
                          "prefill_16x1024": _case(), "prefix_tail": figures})
    assert "unrolled into the decode graph" in table and "the same step not unrolled" in table


def _case() -> dict:
    return {"ms": 2.0, "floor_ms": 1.0}


class _Ordered(_StandIn):
    """Records launches and collects in order; a launch answers its index as the pending step."""

    def __init__(self):
        super().__init__()
        self.events = []

    def launch(self, specs, sampling, family, tokens, route, glue, scoring=()):
        super().launch(specs, sampling, family, tokens, route, glue)
        self.events.append(("launch", len(self.launched) - 1))
        return len(self.launched) - 1

    def collect(self, pending):
        self.events.append(("collect", pending))


def test_a_chained_decode_step_is_launched_before_the_one_before_it_is_collected(monkeypatch):
    """The chain keeps one step in flight: launch 0, launch 1, collect 0, launch 2, collect 1, ...,
    each step collected once and in order, every step the same decode rows; the table shows it
    against the floor."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    executor = _Ordered()
    ms = bench._chain_ms(executor, [(1, bench.CONTEXT)] * 8, 16, iters=4, num_steps=5)
    assert ms >= 0
    first = executor.events[:10]
    assert first == [("launch", 0), ("launch", 1), ("collect", 0), ("launch", 2), ("collect", 1),
                     ("launch", 3), ("collect", 2), ("launch", 4), ("collect", 3), ("collect", 4)]
    collected = [i for kind, i in executor.events if kind == "collect"]
    assert collected == list(range(len(executor.launched)))
    assert all(rows == [(1, bench.CONTEXT)] * 8 for rows, *_ in executor.launched)
    table = bench._table({"device": "stand-in", "copy_bandwidth_tb_s": 4.0, "matmul_tflop_s": 700.0,
                          "decode": {"8": {"ms": 3.0, "floor_ms": 1.0, "chain_ms": 2.0}},
                          "mixed_63_1": _case(), "prefill_1x512": _case(), "prefill_16x1024": _case()})
    row = next(line for line in table.splitlines() if line.startswith("decode 8"))
    assert row.split()[-2:] == ["2.000", "2.00"]


def test_the_table_says_how_many_edges_the_blas_what_if_rewrote():
    base = {"device": "stand-in", "copy_bandwidth_tb_s": 4.0, "matmul_tflop_s": 700.0, "decode": {},
            "mixed_63_1": _case(), "prefill_1x512": _case(), "prefill_16x1024": _case()}
    assert "made programmatic" not in bench._table(base)
    assert "made programmatic: 65" in bench._table(dict(base, programmatic_blas_edges=65))
    off = bench._table(dict(base, programmatic_blas_edges=0, blas_edges_off="cuda-bindings 13 is not installed"))
    assert "made programmatic: 0 (off: cuda-bindings 13 is not installed)" in off


def test_the_table_says_what_the_prompt_rule_graphs_did():
    base = {"device": "stand-in", "copy_bandwidth_tb_s": 4.0, "matmul_tflop_s": 700.0, "decode": {},
            "mixed_63_1": _case(), "prefill_1x512": _case(), "prefill_16x1024": _case()}
    assert "prompt rule graphs" not in bench._table(base)  # a plain decoder has none
    table = bench._table(dict(base, rule_graphs={"captured": 12, "replayed": 192}))
    assert "prompt rule graphs: 12 captured, 192 replays\n" in table + "\n"
    table = bench._table(dict(base, rule_graphs={"captured": 12, "replayed": 204, "as_is": 3}))
    assert "prompt rule graphs: 12 captured, 204 replays, 3 calls of fla as it is\n" in table + "\n"
    assert "norms folded" in bench._table(dict(base, folded_norms=True))
    assert "norms folded" not in bench._table(dict(base, folded_norms=False))
    assert "merged in the kernel" in bench._table(dict(base, decode_merge_in_kernel=True))
    off = bench._table(dict(base, rule_graphs={"captured": 0, "replayed": 0, "off": "turned off (--no-rule-graphs)"}))
    assert "prompt rule graphs: 0 captured, 0 replays (off: turned off (--no-rule-graphs))" in off


def test_the_what_if_switches_reach_the_modules_they_turn_off(monkeypatch):
    """`--no-rule-graphs`, `--no-pdl`, `--module-layout`, `--no-blas-pdl` set their modules' switches
    before the engine is built, and `--flashinfer-packed` turns the Triton packed keys off; without
    them every switch is back at its default. `--fold-norms` and `--decode-merge-in-kernel` turn
    their what-ifs on (off by default)."""
    from mstar.runtime.engine.gpu import (blas_edges, decode_attention, kernels, norm_folding, packed_graphs, products,
                                          rule_graphs)

    for module, name in ((rule_graphs, "_why_off"), (kernels, "_pdl_allowed"), (products, "_transposed_allowed"),
                         (blas_edges, "_enabled"), (packed_graphs, "_triton_packed"), (norm_folding, "_enabled"),
                         (decode_attention, "_merges_in_kernel")):
        monkeypatch.setattr(module, name, getattr(module, name))
    parser = bench._parser()
    bench._set_what_ifs(parser.parse_args(["--no-rule-graphs", "--no-pdl", "--module-layout", "--no-blas-pdl",
                                           "--flashinfer-packed", "--fold-norms", "--decode-merge-in-kernel"]))
    assert rule_graphs._why_off and not kernels._pdl_allowed and not products._transposed_allowed
    assert not blas_edges._enabled and not packed_graphs._triton_packed and norm_folding.is_enabled()
    assert decode_attention._merges_in_kernel
    bench._set_what_ifs(parser.parse_args([]))
    assert rule_graphs._why_off is None and kernels._pdl_allowed and products._transposed_allowed
    assert blas_edges._enabled and packed_graphs._triton_packed and not norm_folding.is_enabled()
    assert not decode_attention._merges_in_kernel
    assert parser.parse_args(["--decode-graphs-only"]).decode_graphs_only


class _Event:
    """Stand-in CUDA event: times nothing, answers 6 ms between two."""

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 6.0


class _WholeGraphs:
    def __init__(self):
        self.replayed = []

    def replay(self, key):
        self.replayed.append(key)


def test_a_chunk_step_on_a_whole_graph_also_times_the_graphs_replay_alone(monkeypatch):
    """The device's share of a chunk step: after one engine step (staged, planned), the whole
    graph's replays alone between two CUDA events (the profiler's kernel sums count a kernel's PDL
    wait); the key is the one the executor picks for the step's rows, decode rows first on the
    split route. A step on no whole graph gets no replay figure."""
    plan, node, shapes, executor = _bench_setup(monkeypatch, (2.0, 0.5))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    executor.packed_graphs = _WholeGraphs()
    asked = []

    def whole_key(specs, family, tokens, num_decode):
        asked.append((len(specs), family, tokens, num_decode))
        return (tokens, 64, "split")

    executor.whole_key = whole_key
    out: dict = {}
    bench._chunk_steps(out, plan, node, executor, 16, 8, shapes, 4e12, 7e14)
    expected_bucket = bench.packed_bucket(plan, node, [(1, bench.CONTEXT)] * 40 + [(216, 0)], True)
    for figures in out["chunk"].values():
        assert figures["replay_ms"] == 2.0  # 6 ms over max(8 // 4, 3) = 3 replays
    assert asked == [(41, expected_bucket[0], expected_bucket[1], 40 if expected_bucket[2] == "split" else 0)] * 3
    assert executor.packed_graphs.replayed == [(expected_bucket[1], 64, "split")] * 9
    lines = bench._table({"device": "stand-in", "copy_bandwidth_tb_s": 4.0, "matmul_tflop_s": 700.0, "decode": {},
                          "mixed_63_1": _case(), "prefill_1x512": _case(), "prefill_16x1024": _case(),
                          "chunk": out["chunk"]})
    assert "replay 2.000 ms; kernels 2.000 ms" in lines
    executor.whole_key = lambda *args: None  # the step takes no whole graph
    bench._chunk_steps(out, plan, node, executor, 16, 8, shapes, 4e12, 7e14)
    assert all("replay_ms" not in figures for figures in out["chunk"].values())


def test_a_steps_flops_count_the_lm_head_once_a_row():
    """The forward gathers each row's last token before the LM head: a 1,024-token prompt's floor
    is its layers' products for every token and the head's for one (before, the head's for every
    token: Llama-3.2-1B's prefill floor read about a quarter high)."""
    node = next(n for n in load_plan(PLAN).nodes if n.engine == "kv")
    shapes = bench.Shapes(decoder_dims(node, "spec"), weight_bytes=1, matmul_params=10, head_params=100)
    assert shapes.model_flops([(5, 0), (3, 7)]) == 2 * 8 * 10 + 2 * 2 * 100
    with_head_per_token = bench.Shapes(shapes.dims, weight_bytes=1, matmul_params=110)
    assert shapes.floor_ms([(1024, 0)], 1e12, 1e12) < with_head_per_token.floor_ms([(1024, 0)], 1e12, 1e12)
    assert shapes.floor_ms([(1, 9)], 1e12, 1e12) == with_head_per_token.floor_ms([(1, 9)], 1e12, 1e12)
