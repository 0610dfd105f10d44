"""The kv node model: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Layers are full softmax attention over the paged KV cache, or gated delta-net linear attention over
recurrent slots (the Qwen3.5 3:1 pattern), as `DecoderDims.layer_is_full` says. The `qwen3_5`
style adds Qwen3.5's details: zero-centred norms, q/k norms, gated attention output, partial RoPE. Besides the token
embedding and the LM head the model has a small image-flow head for BAGEL-style `image_gen`: latent
rows and a timestep are projected in, and a velocity is read out of the same hidden states.

Parameter names follow Hugging Face's LlamaForCausalLM and Qwen3_5ForCausalLM
(`model.layers.{i}.self_attn.q_proj.weight`, `model.layers.{i}.linear_attn.in_proj_qkv.weight`, ...)
so those checkpoints load by name (see `mstar.runtime.engine.weights`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import nn

from mstar.runtime.engine.attention.routes import attend
from mstar.runtime.engine.attention.torch_paged import Segment
from mstar.plan.dims import DecoderDims
from mstar.runtime.engine.kv.cache import KvCache
from mstar.runtime.engine.models.gdn import GatedDeltaNet, LinearStates
from mstar.runtime.engine.models.layers import Bounds, ModuleSeq, RMSNorm, SwiGLU, seg_linear
from mstar.runtime.engine.models.rope import apply_rotary, span_lengths


@dataclass
class DecoderBatch:
    """A packed step: token positions, row spans, attention segments and recurrent slots per row."""

    positions: torch.Tensor  # [N] absolute position of every token
    bounds: Bounds
    segments: list[Segment]
    slots: list[int]  # recurrent slot per row (unused without linear layers)
    # Attention over the paged cache for this step: (q, k, v, cache_k, cache_v, scale) -> out.
    # None: the torch path of the step's attention `route` (attention/routes.py) over `segments`;
    # a GPU step may plan FlashInfer.
    attend: Optional[Callable[..., torch.Tensor]] = None
    route: str = "packed"  # the plan's attention route of the step (MixtureEntry.attention)

    def to_device(self, device: torch.device) -> "DecoderBatch":
        segments = [replace(s, flat_index=s.flat_index.to(device)) for s in self.segments]
        return replace(self, positions=self.positions.to(device), segments=segments)


class FullAttention(nn.Module):
    """Grouped-query attention over the paged cache. Options from the dims: biases on q/k/v and o
    (Llama's attention_bias, Qwen2's q/k/v), per-head q/k RMSNorm before RoPE (Qwen3), scaled or
    partial RoPE; the qwen3_5 style has zero-centred q/k norms and a sigmoid gate (from q_proj)
    on the output."""

    def __init__(self, dims: DecoderDims):
        super().__init__()
        self.dims = dims
        self.is_gated = dims.style == "qwen3_5"
        q_width = dims.num_qo_heads * dims.head_dim * (2 if self.is_gated else 1)
        kv_width = dims.num_kv_heads * dims.head_dim
        self.q_proj = nn.Linear(dims.hidden, q_width, bias=dims.has_qkv_bias)
        self.k_proj = nn.Linear(dims.hidden, kv_width, bias=dims.has_qkv_bias)
        self.v_proj = nn.Linear(dims.hidden, kv_width, bias=dims.has_qkv_bias)
        self.o_proj = nn.Linear(dims.num_qo_heads * dims.head_dim, dims.hidden, bias=dims.has_o_bias)
        self.has_qk_norm = self.is_gated or dims.has_qk_norm
        if self.has_qk_norm:
            self.q_norm = RMSNorm(dims.head_dim, dims.rms_eps, is_zero_centred=self.is_gated)
            self.k_norm = RMSNorm(dims.head_dim, dims.rms_eps, is_zero_centred=self.is_gated)

    def forward(self, x: torch.Tensor, batch: DecoderBatch, cache_k: torch.Tensor,
                cache_v: torch.Tensor) -> torch.Tensor:
        d = self.dims
        n = x.shape[0]
        q = seg_linear(x, self.q_proj.weight, batch.bounds, self.q_proj.bias)
        k = seg_linear(x, self.k_proj.weight, batch.bounds, self.k_proj.bias).view(n, d.num_kv_heads, d.head_dim)
        v = seg_linear(x, self.v_proj.weight, batch.bounds, self.v_proj.bias).view(n, d.num_kv_heads, d.head_dim)
        gate = None
        if self.is_gated:
            # q_proj gives [query | gate] per head (not two halves of the whole output).
            q, gate = q.view(n, d.num_qo_heads, 2 * d.head_dim).split(d.head_dim, dim=-1)
        q = q.reshape(n, d.num_qo_heads, d.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary_dim = d.rotary_dim if d.partial_rotary < 1.0 else 0
        seq_lens = span_lengths(batch.positions, batch.bounds) if d.rope.kind == "dynamic" else None
        q = apply_rotary(q, batch.positions, d.rope_theta, rotary_dim, d.rope, seq_lens)
        k = apply_rotary(k, batch.positions, d.rope_theta, rotary_dim, d.rope, seq_lens)
        # The cache's dtype rules (fp32 on the CPU, bf16 on a GPU, whatever autocast produced).
        q, k, v = q.to(cache_k.dtype), k.to(cache_k.dtype), v.to(cache_k.dtype)
        if batch.attend is not None:
            out = batch.attend(q, k, v, cache_k, cache_v, d.head_dim ** -0.5)
        else:
            out = attend(batch.route, q, k, v, cache_k, cache_v, batch.segments, d.head_dim ** -0.5)
        out = out.reshape(n, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(n, -1))
        return seg_linear(out, self.o_proj.weight, batch.bounds, self.o_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, dims: DecoderDims, is_full: bool):
        super().__init__()
        self.is_full = is_full
        is_centred = dims.style == "qwen3_5"
        self.input_layernorm = RMSNorm(dims.hidden, dims.rms_eps, is_centred)
        if is_full:
            self.self_attn = FullAttention(dims)
        else:
            self.linear_attn = GatedDeltaNet(dims.hidden, dims.num_linear_heads, dims.linear_key_dim,
                                             dims.linear_value_dim, dims.conv_kernel, dims.rms_eps,
                                             dims.num_linear_value_heads)
        self.post_attention_layernorm = RMSNorm(dims.hidden, dims.rms_eps, is_centred)
        self.mlp = SwiGLU(dims.hidden, dims.intermediate, dims.has_mlp_bias)


class DecoderBody(nn.Module):
    """Embedding, layers and final norm: the `model.*` tensors of a Hugging Face checkpoint."""

    def __init__(self, dims: DecoderDims):
        super().__init__()
        # No N(0, 1) fill here: init_random or a checkpoint sets every weight, and at a 128k vocabulary
        # that fill costs seconds (even on the meta device, where the loader builds the model).
        self.embed_tokens = nn.Embedding(dims.vocab, dims.hidden, _weight=torch.empty(dims.vocab, dims.hidden))
        self.layers = ModuleSeq(DecoderLayer(dims, is_full) for is_full in dims.layer_is_full)
        self.norm = RMSNorm(dims.hidden, dims.rms_eps, dims.style == "qwen3_5")


class FlowHead(nn.Module):
    """The image-flow head (BAGEL image_gen): latents in, velocities out (`flow.*` tensors)."""

    def __init__(self, dims: DecoderDims):
        super().__init__()
        self.latent_in = nn.Linear(dims.latent_channels, dims.hidden, bias=False)
        self.time_in = nn.Linear(dims.hidden, dims.hidden, bias=False)
        self.latent_out = nn.Linear(dims.hidden, dims.latent_channels, bias=False)


class Decoder(nn.Module):
    is_sharded = False  # a tensor-parallel rank's shard (`tp/sharded.py`) sums partial outputs across ranks

    def __init__(self, dims: DecoderDims):
        super().__init__()
        self.dims = dims
        self.model = DecoderBody(dims)
        self.lm_head = nn.Linear(dims.hidden, dims.vocab, bias=False)
        self.flow = FlowHead(dims)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (any integers; taken modulo the vocabulary) -> `[T, hidden]`."""
        return self.model.embed_tokens(token_ids.long() % self.dims.vocab)

    def local_embedding(self) -> Optional[torch.Tensor]:
        """The embedding table `[vocab, hidden]` when every token id embeds from it on this process
        alone (a fused kernel may then gather from it, `gpu/kernels.embed_rmsnorm`); None where the
        vocabulary is split between ranks (`tp/sharded.py`)."""
        return self.model.embed_tokens.weight

    def embed_latents(self, latents: torch.Tensor, time_index: int, num_steps: int) -> torch.Tensor:
        """Latent rows `[n, C]` at flow step `time_index` of `num_steps` -> `[n, hidden]`."""
        t = time_index / max(num_steps, 1)
        freqs = torch.exp(-math.log(10000.0) * torch.arange(self.dims.hidden // 2) / (self.dims.hidden // 2))
        time_features = torch.cat([torch.sin(t * freqs), torch.cos(t * freqs)])
        if time_features.shape[0] < self.dims.hidden:
            time_features = torch.cat([time_features, torch.zeros(1)])
        bounds = [(0, latents.shape[0])]
        return seg_linear(latents, self.flow.latent_in.weight, bounds) + self.flow.time_in(time_features)

    def velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states of latent rows -> flow velocity `[n, C]`."""
        return seg_linear(hidden, self.flow.latent_out.weight, [(0, hidden.shape[0])])

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """`[R, hidden]` (one row per request) -> `[R, vocab]`, row by row (batch-invariant)."""
        return self.gather_vocab(
            seg_linear(last_hidden, self.lm_head.weight, [(i, i + 1) for i in range(last_hidden.shape[0])]))

    def forward(self, x: torch.Tensor, batch: DecoderBatch, cache: Optional[KvCache],
                states: Optional[LinearStates]) -> torch.Tensor:
        """Input embeddings `[N, hidden]` -> final normed hidden states `[N, hidden]`."""
        num_full = num_linear = 0
        for layer in self.model.layers:
            normed = layer.input_layernorm(x)
            if layer.is_full:
                assert cache is not None, "a decoder with full-attention layers runs with a KV cache"
                mixed = layer.self_attn(normed, batch, cache.k[num_full], cache.v[num_full])
                num_full += 1
            else:
                assert states is not None, "a decoder with gated delta-net layers runs with linear states"
                mixed = layer.linear_attn(normed, batch.bounds, batch.slots, states.conv[num_linear],
                                          states.ssm[num_linear])
                num_linear += 1
            x = x + self.reduce_partial(mixed)
            x = x + self.reduce_partial(layer.mlp(layer.post_attention_layernorm(x), batch.bounds))
        return self.model.norm(x)

    def reduce_partial(self, x: torch.Tensor) -> torch.Tensor:
        """A mixer's or an MLP's output as the layer adds it to the residual: here the output itself;
        a tensor-parallel rank's model (`engine/tp/sharded.py`) sums its row-parallel partial outputs
        across the group."""
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits `[R, vocab]` of the LM head's rows: here all of them; a tensor-parallel rank
        gathers every rank's vocabulary slice."""
        return logits
