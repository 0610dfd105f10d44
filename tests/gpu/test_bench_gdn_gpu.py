"""`mstar bench gdn` on a CUDA GPU: every variant timed at every row count, the floor below the
kernel, the variants' outputs close to the kernel's own. Skipped without a GPU."""
import pytest
import torch

from mstar.runtime.engine.gpu import bench_gdn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_gdn_bench_times_every_variant():
    shape = bench_gdn.GdnShape(num_layers=3, num_heads=16, num_value_heads=16, key_dim=128, value_dim=128,
                               conv_kernel=4, eps=1e-6)
    result = bench_gdn.run(shape, [128, 64], iters=3)
    assert result["value_block"] == 32 and set(result["rows"]) == {"1", "8", "64"}
    for case in result["rows"].values():
        assert 0 < case["floor_us"] < case["kernel_us"]
        for block in ("128", "64"):
            variant = case[block]
            assert variant["us"] > 0 and variant["conv_equal"] and variant["counts_left_zero"]
            assert variant["max_out_diff"] < 3e-2 and variant["max_state_diff"] < 1e-4
    assert "one a head us" in bench_gdn.table(result)
