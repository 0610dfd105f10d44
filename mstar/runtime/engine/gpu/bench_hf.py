"""HF transformers on the bench's shapes (`mstar bench engine`): LlamaForCausalLM in bf16 with random
weights at the node's dims; a decode step of R rows after a context of 1024 tokens.

Eager: DynamicCache (SDPA), one forward of R tokens, median over iterations (the cache grows by
one position per iteration, 1024 -> 1024 + iters). Compiled (`--hf-compiled`): a StaticCache and
`torch.compile(mode="reduce-overhead")` on the forward, per row count (each compiles apart).
Adds `hf_eager_decode_64_ms` and `decode[R]["hf_compiled_ms"]` to the result.
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.gpu.bench import CONTEXT, DECODE_ROWS, _median_ms


def _model(dims):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
                         num_hidden_layers=dims.num_layers, num_attention_heads=dims.num_qo_heads,
                         num_key_value_heads=dims.num_kv_heads, head_dim=dims.head_dim, rope_theta=dims.rope_theta,
                         max_position_embeddings=8192, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def _eager_decode_ms(model, rows: int, iters: int) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        prompt = torch.randint(0, 1000, (rows, CONTEXT), device="cuda")
        model(prompt, past_key_values=cache, use_cache=True)
        token = torch.randint(0, 1000, (rows, 1), device="cuda")
        return _median_ms(lambda: model(token, past_key_values=cache, use_cache=True), iters)


def _compiled_decode_ms(model, rows: int, iters: int) -> float:
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_batch_size=rows, max_cache_len=CONTEXT + 64 + iters,
                        device="cuda", dtype=torch.bfloat16)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        prompt = torch.randint(0, 1000, (rows, CONTEXT), device="cuda")
        model(prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(CONTEXT, device="cuda"))
        token = torch.randint(0, 1000, (rows, 1), device="cuda")
        position = torch.tensor([CONTEXT], device="cuda")
        return _median_ms(lambda: forward(token, past_key_values=cache, use_cache=True, cache_position=position),
                          iters, warmup=5)


def add_hf(result: dict, dims, iters: int, is_compiled: bool) -> None:
    model = _model(dims)
    try:
        result["hf_eager_decode_64_ms"] = round(_eager_decode_ms(model, 64, max(iters // 5, 5)), 3)
        if is_compiled:
            for rows in DECODE_ROWS:
                result["decode"][str(rows)]["hf_compiled_ms"] = round(_compiled_decode_ms(model, rows, iters), 3)
    except Exception as error:  # transformers' API moves between versions: report, don't crash the bench
        result["hf_error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        del model
        torch.cuda.empty_cache()
