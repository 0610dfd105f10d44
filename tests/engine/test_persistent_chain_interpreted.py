"""The products of a step as phases of one persistent kernel (`engine/gpu/persistent_chain.py`) and
the chain bench around it (`engine/gpu/bench_chain.py`), under the Triton interpreter on the CPU:
the arithmetic of every phase (the interpreter runs a launch a phase: its programs run one after
another, so no grid barrier could be passed; tests/gpu/test_persistent_chain_gpu.py runs the
barrier and the prefetch)."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from mstar.runtime.engine.gpu import bench_chain  # noqa: E402
from mstar.runtime.engine.gpu.persistent_chain import ChainPhase, split_for  # noqa: E402

SHAPES = [("q/k/v", 64, 96), ("o", 80, 64), ("gate/up", 64, 208), ("down", 160, 48)]  # K > N before it too


@pytest.fixture
def chain_module():
    skip_unless_child("test_persistent_chain_under_the_interpreter")
    from mstar.runtime.engine.gpu import persistent_chain
    return persistent_chain


@parent_only
def test_persistent_chain_under_the_interpreter():
    run_child(__file__, "9 passed")


@pytest.mark.parametrize("rows, programs", [(1, 4), (5, 40), (17, 7), (64, 64)])
def test_every_phase_is_its_operands_product(chain_module, rows, programs):
    phases = bench_chain.build_phases(SHAPES, rows, torch.device("cpu"))
    chain = chain_module.PersistentChain(phases, programs=programs, block_n=16, block_k=16)
    chain()
    assert bench_chain.max_rel_error(phases) < 0.02
    assert not chain.counters.any(), "the last piece of a tile sets its counter back to zero"
    assert not chain.barrier.any() and not chain.faulted
    if programs >= 40:
        assert max(c.split for c in chain.configs) > 1, "the case is meant to split K"


def test_a_second_run_gives_the_same_outputs_bit_for_bit(chain_module):
    phases = bench_chain.build_phases(SHAPES, 5, torch.device("cpu"))
    chain = chain_module.PersistentChain(phases, programs=40, block_n=16, block_k=16)
    chain()
    first = [phase.out.clone() for phase in phases]
    for phase in phases:
        phase.out.zero_()
    chain()
    assert all(torch.equal(a, phase.out) for a, phase in zip(first, phases))


def test_every_way_of_the_bench_computes_the_chain(chain_module):
    phases = bench_chain.build_phases([("a", 128, 192), ("b", 192, 128), ("c", 128, 256)], 3, torch.device("cpu"))
    runs = bench_chain.ways(phases, prefetch_rows=0)
    assert set(runs) == {"cublas", "skinny", "persistent"}
    for name, run_chain in runs.items():
        for phase in phases:
            phase.out.zero_()
        run_chain()
        assert bench_chain.max_rel_error(phases) < 0.02, name


def test_refusals(chain_module):
    phases = bench_chain.build_phases(SHAPES, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a GPU"):
        chain_module.PersistentChain(phases, prefetch_rows=256)
    with pytest.raises(ValueError, match="at least one"):
        chain_module.PersistentChain([])
    wrong = ChainPhase(phases[0].x, phases[1].weight, phases[0].out)
    with pytest.raises(ValueError, match="do not fit"):
        chain_module.PersistentChain([wrong])
    as_float = ChainPhase(phases[0].x.float(), phases[0].weight, phases[0].out)
    with pytest.raises(ValueError, match="bf16"):
        chain_module.PersistentChain([as_float])
    ragged = bench_chain.build_phases([("a", 64, 40)], 2, torch.device("cpu"))  # N = 40: the hints need 16s
    with pytest.raises(ValueError, match="multiples of 16"):
        chain_module.PersistentChain(ragged)


def test_split_fits_one_round_and_pieces_of_two_blocks():
    for k in (64, 256, 2048, 8192, 8200):
        for n in (64, 1024, 3072, 16384):
            for programs in (4, 132):
                split = split_for(k, n, programs, 64, 128)
                tiles = -(-n // 64)
                assert split == 1 or (tiles * split <= programs and split * 2 * 128 <= k)
                assert split & (split - 1) == 0


def test_chain_order_runs_layer_by_layer():
    named = [("q", 8, 12), ("q", 8, 12), ("o", 8, 8), ("o", 8, 8), ("head", 8, 4)]
    assert [r for r, _, _ in bench_chain.chain_order(named)] == ["q", "o", "head", "q", "o"]
    phases = bench_chain.build_phases([("q", 8, 12), ("o", 16, 8), ("d", 4, 4)], 2, torch.device("cpu"))
    # each input is the previous output's buffer (wider where the next K is larger, zero beyond N)
    assert phases[1].x.data_ptr() == phases[0].out.data_ptr() and phases[1].x.shape == (2, 16)
    assert phases[2].x.data_ptr() == phases[1].out.data_ptr()
