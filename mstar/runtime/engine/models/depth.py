"""A depth model (`submodel NAME(ARGS) samples OUTPUT depth=N`): Qwen3-TTS's code predictor.

In:  per row, the node's last hidden state `[outer_hidden]` and the embedding, by the node's own
     token embedding, of the token the node sampled (codebook 0 of a frame); a `pick(k, logits)`
     that samples inner position k from logits `[1, vocab]`.
Out: `generate(...)` -> the N further tokens of the frame `[N]` (codebooks 1..N), inner position k
     read from its own head `lm_head[k]` over the model's own vocabulary.

The inner loop, as transformers' Qwen3-Omni talker drives its code predictor (`generate` with
`max_new_tokens = num_code_groups - 1`): the sequence starts as [node hidden, embedding of the
node's token]; each inner step runs the layers causally over the sequence, reads the last position
through `lm_head[k]`, samples, and appends `codec_embedding[k]` of that token. Its KV lives for the
one frame only (at most N + 1 positions), so each inner step recomputes the short sequence densely
instead of holding pages. When the model is narrower than the node (Qwen3-TTS: a 1024-wide
predictor under a 2048-wide Talker), `small_to_mtp_projection` maps the node-wide inputs to its width,
as Qwen3-TTS's code predictor does; the codec embeddings are node-wide for the same reason.

Layers are Qwen3's (RMSNorm on each query and key head before RoPE, SwiGLU MLP, no biases);
parameter names follow transformers' code predictor (`model.layers.{i}.self_attn.q_proj.weight`,
`model.codec_embedding.{k}.weight`, `lm_head.{k}.weight`), so its weights copy over by name.
Rows run one at a time: each row's numbers never depend on which rows share the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mstar.runtime.engine.models.layers import ModuleSeq, RMSNorm, SwiGLU
from mstar.runtime.engine.models.rope import inverse_frequencies
from mstar.plan.dims import LayerStackDims, RopeScaling


@dataclass(frozen=True, kw_only=True)
class DepthDims(LayerStackDims):
    """A depth model's own dims (plain full-attention layers) and the width of the node it reads
    (`outer_hidden`)."""

    depth: int  # inner positions: further tokens per step
    outer_hidden: int
    rms_eps: float = 1e-6  # Qwen3's (transformers' code predictor config)


class DepthAttention(nn.Module):
    def __init__(self, dims: DepthDims):
        super().__init__()
        self.dims = dims
        self.q_proj = nn.Linear(dims.hidden, dims.num_qo_heads * dims.head_dim, bias=False)
        self.k_proj = nn.Linear(dims.hidden, dims.num_kv_heads * dims.head_dim, bias=False)
        self.v_proj = nn.Linear(dims.hidden, dims.num_kv_heads * dims.head_dim, bias=False)
        self.o_proj = nn.Linear(dims.num_qo_heads * dims.head_dim, dims.hidden, bias=False)
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_eps)
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[L, hidden]` -> causal self-attention over the L positions `[L, hidden]`."""
        d, length = self.dims, x.shape[0]
        q = self.q_norm(self.q_proj(x).view(length, d.num_qo_heads, d.head_dim))
        k = self.k_norm(self.k_proj(x).view(length, d.num_kv_heads, d.head_dim))
        v = self.v_proj(x).view(length, d.num_kv_heads, d.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = d.num_qo_heads // d.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * d.head_dim ** -0.5
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out = torch.einsum("hqk,khd->qhd", weights, v.float()).to(x.dtype)
        return self.o_proj(out.reshape(length, -1))


class DepthLayer(nn.Module):
    def __init__(self, dims: DepthDims):
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden, dims.rms_eps)
        self.self_attn = DepthAttention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden, dims.rms_eps)
        self.mlp = SwiGLU(dims.hidden, dims.intermediate)


class DepthBody(nn.Module):
    """Layers, final norm and the per-position codec embeddings (the `model.*` tensors)."""

    def __init__(self, dims: DepthDims):
        super().__init__()
        self.layers = ModuleSeq(DepthLayer(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden, dims.rms_eps)
        # inner position k's token is fed back through codec_embedding[k] (the last one feeds nothing
        # here; transformers' talker reads it for its next input)
        self.codec_embedding = nn.ModuleList(nn.Embedding(dims.vocab, dims.outer_hidden) for _ in range(dims.depth))


class DepthModel(nn.Module):
    def __init__(self, dims: DepthDims):
        super().__init__()
        self.dims = dims
        self.model = DepthBody(dims)
        self.lm_head = nn.ModuleList(nn.Linear(dims.hidden, dims.vocab, bias=False) for _ in range(dims.depth))
        self.small_to_mtp_projection = (nn.Linear(dims.outer_hidden, dims.hidden, bias=True)
                                        if dims.outer_hidden != dims.hidden else None)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return self.small_to_mtp_projection(x) if self.small_to_mtp_projection is not None else x

    def hidden_states(self, inputs: torch.Tensor) -> torch.Tensor:
        """Node-wide inputs `[L, outer_hidden]` -> final normed hidden states `[L, hidden]`."""
        x = self._project(inputs)
        length = x.shape[0]
        inv_freq = inverse_frequencies(RopeScaling(), self.dims.rope_theta, self.dims.head_dim).to(x.device)
        freqs = torch.arange(length, device=x.device).float().unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        bounds = [(0, length)]
        for layer in self.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x), bounds)
        return self.model.norm(x)

    def generate(self, outer_hidden: torch.Tensor, first_embed: torch.Tensor,
                 pick: Callable[[int, torch.Tensor], int]) -> list[int]:
        """One row: the frame's further tokens (module docstring), `depth` of them."""
        inputs = [outer_hidden.reshape(1, -1), first_embed.reshape(1, -1)]
        tokens: list[int] = []
        for k in range(self.dims.depth):
            hidden = self.hidden_states(torch.cat(inputs))
            token = pick(k, self.lm_head[k](hidden[-1:]))
            tokens.append(token)
            if k + 1 < self.dims.depth:
                ids = torch.tensor([token], device=outer_hidden.device)
                inputs.append(self.model.codec_embedding[k](ids).to(outer_hidden.dtype))
        return tokens


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `[L, heads, head_dim]` (transformers' rotate_half form)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
