"""`mstar bench products` (`engine/gpu/bench_products.py`) on the CPU: the step's product shapes as
`DecoderForward` builds them, the per-step sums and the layouts' comparison with the GPU timer
stubbed, the table, the refusals (the timing itself needs a GPU: tests/gpu/test_bench_products_gpu.py)."""
import json
from pathlib import Path

import pytest
import torch

from mstar.plan.dims import decoder_dims
from mstar.plan.io import load_plan
from mstar.runtime.engine.gpu import bench, bench_decode_attention, bench_products

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def _dims(plan: str, which: str = "spec"):
    node = next(n for n in load_plan(str(GENERATED / f"{plan}.plan")).nodes if n.engine == "kv")
    return decoder_dims(node, which)


def test_llamas_products_one_shape_a_role():
    shapes = bench_products.product_shapes(_dims("llama"))
    assert [(s.roles, s.in_features, s.out_features, s.per_step) for s in shapes] == [
        (("q/k/v",), 2048, 3072, 16), (("o",), 2048, 2048, 16), (("gate/up",), 2048, 16384, 16),
        (("down",), 8192, 2048, 16), (("lm_head",), 2048, 128256, 1)]


def test_qwen3_5s_attention_and_linear_out_projections_share_a_shape():
    """6 full-attention layers (gated q: [query | gate] per head) and 18 gated delta-net layers; the
    attention's o and the linear layers' out projection are both 2048 -> 1024 (24 a step)."""
    shapes = {s.roles: s for s in bench_products.product_shapes(_dims("qwen3_5"))}
    assert (shapes[("o", "linear out")].in_features, shapes[("o", "linear out")].out_features,
            shapes[("o", "linear out")].per_step) == (2048, 1024, 24)
    assert (shapes[("q/k/v",)].out_features, shapes[("q/k/v",)].per_step) == (8 * 256 * 2 + 2 * 2 * 256, 6)
    assert (shapes[("linear in",)].out_features, shapes[("linear in",)].per_step) == (3 * 16 * 128 + 16 * 128 + 32,
                                                                                       18)
    assert shapes[("lm_head",)].weight_bytes == 1024 * 248320 * 2


def test_run_sums_a_step_and_compares_the_layouts(monkeypatch):
    """With the GPU timer stubbed (each graph's calls run once; 2 us a stored product, 3 a module
    one), a step's sum is each shape's count times its time, and the two layouts of the same
    weights give outputs within bf16 rounding."""
    calls = []

    def fake_graph_us(fn, iters, num_calls):
        outs = fn()
        calls.append(len(outs))
        return 2.0 if len(calls) % 2 else 3.0  # stored first, then module, as `_case` times them

    monkeypatch.setattr(bench_decode_attention, "graph_us", fake_graph_us)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4e12)
    shapes = bench_products.product_shapes(_dims("qwen3_5", "tiny"))
    result = bench_products.run(shapes, [1, 3], iters=1, device=torch.device("cpu"))
    assert all(n == bench_products.WEIGHTS_A_GRAPH for n in calls)
    total = sum(s.per_step for s in shapes)
    heads = sum(s.per_step for s in shapes if "lm_head" in s.roles)
    # no skinny kernel on the CPU: its sums take cuBLAS's times as the engine would run each there,
    # the LM head on the modules' [out, in] (it was counted at the [in, out] time), the others [in, out]
    assert heads == 1 and result["step_us"] == {
        r: {"stored": 2.0 * total, "module": 3.0 * total, "skinny": 2.0 * (total - heads) + 3.0 * heads}
        for r in ("1", "3")}
    for shape, measured in zip(shapes, result["shapes"]):
        assert measured["floor_us"] == pytest.approx(shape.weight_bytes / 4e12 * 1e6, abs=1e-3)
        for case in measured["rows"].values():
            assert case["stored_us"] == 2.0 and case["module_us"] == 3.0
            assert case["max_diff"] < 5e-2
    lines = bench_products.table(result).splitlines()
    assert len(lines) == 2 + len(shapes) + 3
    assert all(", ".join(shape.roles) in bench_products.table(result) for shape in shapes)
    assert f"1 rows module 1.50x, skinny {(2.0 * (total - 1) + 3.0) / (2.0 * total):.2f}x" in lines[-2]


def test_refusals_say_why(capsys):
    assert bench_products.main(["--plan", str(GENERATED / "llama.plan"), "--node", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mstar bench products: ") and "no kv node 'nope' (its kv nodes: LLM)" in err
    assert bench_products.main(["--plan", "missing.plan"]) == 1
    assert "missing.plan" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_products.main(["--rows", "0"])
    if not torch.cuda.is_available():
        assert bench_products.main(["--plan", str(GENERATED / "llama.plan"), "--json"]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_rows_keep_their_order_once_each():
    assert bench_products._rows("8, 1,8,64") == [8, 1, 64]
    assert json.loads(json.dumps(bench_products.ROWS)) == [1, 2, 4, 8, 16, 64]


def test_the_skinny_sweep_lists_its_configs_and_its_table():
    """`--skinny-sweep` (engine/gpu/skinny_sweep.py): 50 distinct launch configs, and one table line
    a case naming cuBLAS, config_for's config and the fastest with its ratio."""
    from mstar.runtime.engine.gpu import skinny_sweep

    configs = skinny_sweep.configs()
    assert len(configs) == len(set(configs)) == 50
    result = {"device": "H200", "copy_tb_s": 4.1, "cases": [
        {"roles": ["down"], "k": 8192, "n": 2048, "rows": 64, "gated": True, "floor_us": 8.23, "cublas_us": 15.55,
         "config_for": "n64 k128 split8 w4 s4", "config_for_us": 56.24,
         "best": [[26.61, "n128 k128 split8 w4 s4"], [34.5, "n128 k128 split8 w8 s4"]]}]}
    lines = skinny_sweep.table(result).splitlines()
    assert len(lines) == 2 and "down gated 8192 -> 2048" in lines[1]
    assert "cuBLAS   15.55" in lines[1] and "best   26.61 (n128 k128 split8 w4 s4, 1.71)" in lines[1]


def test_the_skinny_sweep_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert bench_products.main(["--plan", str(GENERATED / "llama.plan"), "--skinny-sweep"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_chain_refuses_what_it_cannot_run(capsys):
    """`--chain` (engine/gpu/bench_chain.py): one tile of at most 64 rows, not beside --skinny-sweep,
    and a GPU; its table reads each way's figures and flags a barrier that gave up."""
    from mstar.runtime.engine.gpu import bench_chain

    llama = str(GENERATED / "llama.plan")
    for argv in (["--chain", "--rows", "65"], ["--chain", "--skinny-sweep"]):
        with pytest.raises(SystemExit):
            bench_products.main(["--plan", llama, *argv])
    capsys.readouterr()
    if not torch.cuda.is_available():
        assert bench_products.main(["--plan", llama, "--chain"]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err
    way = {"us": 1500.0, "x_floor": 2.6, "beyond_floor_us_a_product": 14.4, "max_rel_error": 4e-3}
    result = {"device": "H200", "copy_tb_s": 4.1, "products": 64, "floor_us": 580.0,
              "rows": {"64": {w: dict(way) for w in bench_chain.WAYS}}}
    result["rows"]["64"]["persistent"]["barrier_gave_up"] = True
    lines = bench_chain.table(result).splitlines()
    assert "64 matrix products" in lines[0] and "floor 580.0 us" in lines[0]
    assert lines[2].count("1500.0 (2.60x, 14.40)") == 4 and "!" in lines[2]
    assert "a barrier gave up" in lines[-1]


def test_the_chain_runs_the_step_layer_by_layer():
    from mstar.runtime.engine.gpu import bench_chain

    order = bench_chain.chain_order(bench_products.named_products(_dims("llama")))
    assert len(order) == 64
    assert [r for r, _, _ in order[:5]] == ["q/k/v", "o", "gate/up", "down", "q/k/v"]
