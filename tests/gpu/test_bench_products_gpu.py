"""`mstar bench products` on a CUDA GPU: every shape of Llama's step timed in both layouts at every
row count asked, above its floor, the layouts' outputs within bf16 rounding. Skipped without a GPU."""
import json

import pytest
import torch

from mstar.runtime.engine.gpu import bench_products

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_products_bench_times_both_layouts(capsys):
    assert bench_products.main(["--plan", "generated/llama.plan", "--rows", "1,8", "--iters", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["roles"] for s in result["shapes"]] == [["q/k/v"], ["o"], ["gate/up"], ["down"], ["lm_head"]]
    for shape in result["shapes"]:
        assert set(shape["rows"]) == {"1", "8"}
        for case in shape["rows"].values():
            assert case["stored_us"] > 0.5 * shape["floor_us"] and case["module_us"] > 0.5 * shape["floor_us"]
            assert case["max_diff"] < 5e-2
            assert ("skinny_us" in case) == (shape["roles"] != ["lm_head"])  # the split-K kernel beside cuBLAS
    assert set(result["step_us"]) == {"1", "8"}
