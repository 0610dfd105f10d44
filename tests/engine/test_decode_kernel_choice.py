"""The decode kernel a graph of B rows takes (`attention.graph_decode_kernel`: the Triton kernel
where it serves the heads, else `attention.decode_takes_tensor_cores`): FlashInfer's
CUDA-core decode kernel exists only for some grouped-query ratios, so a node of any other ratio
(Qwen3-Omni's thinker: 28 query heads over 4 KV heads) must take the tensor-core kernels at every
batch size, and forcing the CUDA-core kernel there is refused with a reason, not a kernel error."""
from hypothesis import given, strategies as st

from mstar.runtime.engine.gpu.attention import (CUDA_CORE_GROUP_SIZES, CUDA_CORE_MAX_BATCH, cuda_core_refusal,
                                                decode_takes_tensor_cores, graph_decode_kernel)
from mstar.runtime.engine.gpu.bench import main as bench_main


@given(st.integers(1, 16), st.integers(1, 8), st.integers(1, 128))
def test_cuda_core_kernel_only_for_its_group_sizes(group, num_kv_heads, batch):
    takes_tensor = decode_takes_tensor_cores(group * num_kv_heads, num_kv_heads, batch)
    if group not in CUDA_CORE_GROUP_SIZES:
        assert takes_tensor and cuda_core_refusal(group * num_kv_heads, num_kv_heads)
    else:
        assert cuda_core_refusal(group * num_kv_heads, num_kv_heads) is None
        assert takes_tensor == (group >= 4 and batch > CUDA_CORE_MAX_BATCH)


@given(st.integers(1, 16), st.integers(1, 128), st.booleans())
def test_a_forced_kernel_is_kept(group, batch, forced):
    assert decode_takes_tensor_cores(group * 2, 2, batch, forced) is forced


def test_bench_refuses_a_forced_cuda_core_kernel_it_lacks(capsys, monkeypatch):
    monkeypatch.setattr("mstar.runtime.engine.gpu.bench._unavailable", lambda: None)
    code = bench_main(["--plan", "generated/qwen3_omni.plan", "--node", "Thinker", "--decode-kernel", "cuda"])
    err = capsys.readouterr().err
    assert code == 1 and "group size 7" in err and "Traceback" not in err


@given(st.integers(1, 24), st.integers(1, 8), st.sampled_from([16, 64, 80, 128, 256, 512]), st.integers(1, 128))
def test_auto_takes_the_triton_kernel_where_it_serves_the_heads(group, num_kv_heads, head_dim, batch):
    """`graph_decode_kernel`: auto is the Triton decode kernel for any group of at most 16 query
    heads and a power-of-two head dim up to 256, FlashInfer's rule elsewhere; flashinfer is that rule
    everywhere, tensor and cuda force FlashInfer's kernel."""
    heads = (group * num_kv_heads, num_kv_heads, head_dim)
    flashinfer_rule = "tensor" if decode_takes_tensor_cores(heads[0], num_kv_heads, batch) else "cuda"
    serves = group <= 16 and head_dim in (16, 64, 128, 256)
    assert graph_decode_kernel(*heads, batch) == ("triton" if serves else flashinfer_rule)
    assert graph_decode_kernel(*heads, batch, "flashinfer") == flashinfer_rule
    assert graph_decode_kernel(*heads, batch, "tensor") == "tensor"
    assert graph_decode_kernel(*heads, batch, "cuda") == "cuda"

