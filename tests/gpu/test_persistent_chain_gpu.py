"""The persistent chain of products (`engine/gpu/persistent_chain.py`) on a CUDA GPU, where its grid
barriers and L2 prefetch run: every phase is its operands' product, launch after launch and replay
after replay of a CUDA graph (the barrier's counters set back each time), and `mstar bench products
--chain` reports every way. Skipped without a GPU."""
import json

import pytest
import torch

from mstar.runtime.engine.gpu import bench_chain, bench_products
from mstar.runtime.engine.gpu.persistent_chain import PersistentChain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYER = [("q/k/v", 2048, 3072), ("o", 2048, 2048), ("gate/up", 2048, 16384), ("down", 8192, 2048)]


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("prefetch_rows", [0, 256])
def test_the_chain_computes_every_phase_launch_after_launch(rows, prefetch_rows):
    phases = bench_chain.build_phases(LAYER * 3, rows, torch.device("cuda"))
    chain = PersistentChain(phases, prefetch_rows=prefetch_rows)
    for _ in range(3):
        for phase in phases:
            phase.out.zero_()
        chain()
        torch.cuda.synchronize()
        assert not chain.faulted
        assert bench_chain.max_rel_error(phases) < 2e-2
        assert not chain.barrier.any() and not chain.counters.any()


def test_the_chain_replays_in_a_cuda_graph_bit_for_bit():
    phases = bench_chain.build_phases(LAYER * 2, 64, torch.device("cuda"))
    chain = PersistentChain(phases)
    chain()
    torch.cuda.synchronize()
    eager = [phase.out.clone() for phase in phases]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(5):
        for phase in phases:
            phase.out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, phase.out) for a, phase in zip(eager, phases))
    assert not chain.faulted


def test_the_chain_bench_reports_every_way(capsys):
    assert bench_products.main(["--plan", "generated/llama.plan", "--chain", "--rows", "8", "--iters", "3",
                                "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["products"] == 64 and set(result["rows"]) == {"8"}
    case = result["rows"]["8"]
    assert set(case) == set(bench_chain.WAYS)
    for way in case.values():
        assert way["us"] > 0.5 * result["floor_us"] and way["max_rel_error"] < 2e-2
        assert not way.get("barrier_gave_up")
