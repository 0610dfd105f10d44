"""`mstar bench engine --host-pack` runs without a GPU and reports both packers for every bench step."""
import json

from mstar.cli.mstar import main


def test_host_pack_prints_both_packers(capsys):
    assert main(["bench", "engine", "--host-pack", "--iters", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan_key"] == "LLM:mixed" and result["page_size"] == 16
    for step in ("decode_1", "decode_8", "decode_64", "mixed_63_1", "prefill_16x1024", "prefix_tail_16"):
        figures = result[step]
        assert figures["numpy_us"] > 0 and figures["glue_host_us"] > 0
        assert abs(figures["glue_over_numpy"] - figures["glue_host_us"] / figures["numpy_us"]) < 0.01


def test_host_pack_refuses_a_plan_without_glue(tmp_path, capsys):
    assert main(["bench", "engine", "--host-pack", "--plan", str(tmp_path / "missing.plan")]) == 1
    assert "mstar bench engine:" in capsys.readouterr().err


def test_node_picks_the_kv_node_to_bench(capsys):
    """`--node` benches a named kv node (the default is the plan's first); an unknown name is
    refused with the plan's kv nodes."""
    assert main(["bench", "engine", "--host-pack", "--node", "LLM", "--iters", "1", "--json"]) == 0
    capsys.readouterr()
    assert main(["bench", "engine", "--host-pack", "--plan", "generated/qwen3_omni.plan", "--node", "Nope"]) == 1
    assert "no kv node 'Nope' (its kv nodes: Thinker, Talker)" in capsys.readouterr().err


def test_host_pack_refuses_a_plan_whose_steps_are_not_its_cases(capsys):
    """Whisper's decoder feeds no row from the device token table: the bench's decode cases do not
    apply, said in one line (a GlueLaunchError traceback before)."""
    assert main(["bench", "engine", "--host-pack", "--plan", "generated/whisper.plan", "--iters", "1"]) == 1
    err = capsys.readouterr().err
    assert "node decoder's steps are not the decode and prompt steps this bench packs" in err
    assert "Traceback" not in err


def test_host_pack_refuses_a_hybrid_decoder(capsys):
    """Qwen3.5's steps are packed by numpy alone on the GPU: the bench printed a glue column and a
    ratio of a path the engine never takes for it (a bench audit)."""
    assert main(["bench", "engine", "--host-pack", "--plan", "generated/qwen3_5.plan", "--iters", "1"]) == 1
    captured = capsys.readouterr()
    assert "hybrid decoder, whose steps the engine packs with numpy only" in captured.err and captured.out == ""


def test_the_engine_benchs_attention_share_counts_the_attention_kernels():
    """`mstar bench engine`'s attention share: the Triton splits' merge kernel was left out (it
    named neither "prefill" nor "decode") and the gated delta-net's recurrence counted in (a bench audit)."""
    from mstar.runtime.engine.gpu.bench import is_attention_kernel

    attention = ["_decode_split_kernel", "_prefill_kernel", "_merge_kernel",
                 "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>",
                 "void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>",
                 "void flashinfer::PersistentVariableLengthMergeStatesKernel<...>"]
    others = ["_decode_step_kernel", "_recurrent_step_kernel", "_add_rmsnorm_kernel", "_rope_write_kv_kernel",
              "sm90_xmma_gemm_bf16bf16_bf16f32", "_pack_step_llm_mixed_kernel"]
    assert all(map(is_attention_kernel, attention)) and not any(map(is_attention_kernel, others))
