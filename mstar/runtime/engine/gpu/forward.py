"""One step of a decoder over a paged KV cache, on flat device tensors (graph-capturable).

In: the step's token ids `[N]`, positions `[N]`, the flat cache slot each token writes `[N]`, each
row's last-token index `[R]`, and an `attend(layer, q, k_pages, v_pages) -> out` callable (FlashInfer
on a GPU, `torch_attend` elsewhere) already planned for the step; for a hybrid decoder (Qwen3.5's
gated delta-net layers beside full attention) also the step's `LinearStep` (each row's recurrent
slot; `gdn_forward.py` runs those layers). Out: logits `[R, vocab]` in the model's dtype (bf16 on a
GPU: a graph's fp32 copy of 64 rows x Qwen3.5's 248,320 logits took 45 us of a 2.2 ms decode step on
the H200, and the greedy argmax picks the same index in either; `sampler.sample` computes in fp32).

On a tensor-parallel rank the model is its shard (`engine/tp/sharded.py`): the embedding, the
outputs of o_proj and down_proj and the logits go through the model's `embed_tokens`,
`reduce_partial` and `gather_vocab`, the group's collectives (identities on one rank).

Nothing here reads host memory or synchronises: RoPE's cos/sin come from tables built at start-up,
the KV write is an index copy into the cache, so the whole call can be captured in a CUDA graph.
The KV cache (`PagedKv`) is `[layers, 2, pages + 1, page_size, kv_heads, head_dim]`: K and V of a
layer have identical strides (FlashInfer's NHD pages) and the extra last page is a dummy that
padding rows of a captured step read and write, so they never touch a request's pages.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mstar.plan.dims import DecoderDims
from mstar.runtime.engine.gpu import kernels, launch_probe, norm_folding, products, skinny_products
from mstar.runtime.engine.gpu.gdn_forward import GdnForward, LinearCut, LinearLayout, LinearStep, linear_layout
from mstar.runtime.engine.gpu.packing import PackedStep, fed_ids
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.gdn import LinearStates
from mstar.runtime.engine.models.rope import inverse_frequencies

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PagedKv:
    """The node's KV pages on the device, plus one dummy page (module docstring)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        self.dummy_page = num_pages
        self.data = torch.empty(num_layers, 2, num_pages + 1, page_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)

    @property
    def dummy_slot(self) -> int:
        return self.dummy_page * self.page_size

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[layer, 0], self.data[layer, 1]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class DecoderForward:
    """The step function of one decoder (module docstring); holds no per-step state.

    At construction q/k/v and gate/up become one matrix each (concatenated once; the modules'
    parameters become views into it, so no weight is held twice), so a layer runs four matrix
    products, each holding its weight as the device multiplies it fastest (`products.py`). On a
    CUDA device with Triton the norms (with the residual add), RoPE with the K/V write, and
    silu * up are one fused kernel each (`kernels.py`); elsewhere the same arithmetic runs as torch
    ops.
    """

    def __init__(self, model: Decoder, dims: DecoderDims, kv: PagedKv, max_positions: int,
                 states: Optional[LinearStates] = None):
        """states: the recurrent slots of the gated delta-net layers (`gdn_forward.py`), needed
        when the decoder has any."""
        self.model, self.dims, self.kv = model, dims, kv
        device = model.lm_head.weight.device
        rotary = dims.rotary_dim if dims.partial_rotary < 1.0 else dims.head_dim
        self.rotary = rotary
        inv_freq = inverse_frequencies(dims.rope, dims.rope_theta, rotary)
        freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        scale = dims.rope.attention_factor
        # [max_positions, rotary/2] each, fp32: gathered by position every step.
        self.cos = (freqs.cos() * scale).to(device)
        self.sin = (freqs.sin() * scale).to(device)
        self.is_fused = kernels.available(device)
        layers = model.model.layers
        transposed = products.stores_transposed(device)
        full = [layer.self_attn for layer in layers if layer.is_full]  # by index among the full-attention layers
        self.qkv = [products.fuse([attn.q_proj, attn.k_proj, attn.v_proj], transposed) for attn in full]
        self.o = [products.fuse([attn.o_proj], transposed) for attn in full]
        self.gate_up = [products.fuse([layer.mlp.gate_proj, layer.mlp.up_proj], transposed) for layer in layers]
        self.down = [products.fuse([layer.mlp.down_proj], transposed) for layer in layers]
        linear = [layer.linear_attn for layer in layers if not layer.is_full]
        if linear and states is None:
            raise ValueError("a decoder with gated delta-net layers runs with its recurrent states")
        self.gdn = GdnForward(linear, states, transposed) if linear and states is not None else None
        if skinny_products.serves(device):  # a decode step's few rows on the split-K kernel, not cuBLAS
            skinny_products.attach((product for _, product in self.named_products()), device)
        # Per layer: its index among the full-attention layers (KV pages) or the linear ones (slots).
        self.kind_index = [sum(1 for other in layers[:i] if other.is_full == layer.is_full)
                           for i, layer in enumerate(layers)]
        self.folds_norms = False
        # an eager step that keeps every position's final hidden state in `hidden` (the executor's
        # prompt log-probabilities); a piecewise capture writes them into `hidden_into` instead
        self.keep_hidden = False
        self.hidden: Optional[torch.Tensor] = None
        self.hidden_into: Optional[torch.Tensor] = None
        if self.is_fused and norm_folding.is_enabled():
            self.fold_norms()

    def fold_norms(self) -> bool:
        """Folds each layer's norms before its mixer's in-projection (q/k/v, or a gated delta-net
        layer's in_proj) and before gate/up into those products, where they may be
        (`norm_folding.py`); the fused forward then runs with them folded (only the fused kernels
        take a norm's scale). Whether it does."""
        layers = self.model.model.layers
        in_proj = self.gdn.in_proj if self.gdn is not None else []
        if not self.is_fused or not norm_folding.applies(self.model, self.qkv + self.gate_up + in_proj):
            return False
        for index, layer in enumerate(layers):
            norm_folding.fold(layer.post_attention_layernorm, self.gate_up[index])
            mixer_in = self.qkv if layer.is_full else in_proj
            norm_folding.fold(layer.input_layernorm, mixer_in[self.kind_index[index]])
        self.folds_norms = True
        return True

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Half rotation of the first `rotary` dims (Hugging Face's rotate_half), in fp32."""
        half = self.rotary // 2
        x32 = x.float()
        first, second, rest = x32[..., :half], x32[..., half:self.rotary], x32[..., self.rotary:]
        out = torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
        return out.to(x.dtype)

    def _norm(self, x: torch.Tensor, delta: Optional[torch.Tensor], norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)); fused, x is updated in place."""
        if self.is_fused:
            return x, kernels.add_rmsnorm(x, delta, norm.weight, norm.eps, norm.is_zero_centred)
        x = x if delta is None else x + delta
        return x, norm(x)

    def _rope_write(self, q, k, v, positions, slots, k_pages, v_pages, attn,
                    row_norm: Optional[kernels.RowNorm] = None) -> torch.Tensor:
        """q and k per-head normed (when the layer has q/k norms), rotated; k and v written into the
        pages; returns q. Fused: one kernel (the norms inside it; q, k and v first scaled by each
        token's folded norm, `row_norm`)."""
        d = self.dims
        if self.is_fused:
            qk_norm = (kernels.QkNorm(attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
                                      attn.q_norm.is_zero_centred) if attn.has_qk_norm else None)
            return kernels.rope_write_kv(q, k, v, self.cos, self.sin, positions, slots,
                                         k_pages.view(-1, d.num_kv_heads, d.head_dim),
                                         v_pages.view(-1, d.num_kv_heads, d.head_dim), self.rotary, qk_norm,
                                         row_norm)
        assert row_norm is None, "a folded norm's scale runs in the fused kernel"
        if attn.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos = self.cos[positions.long()].unsqueeze(1)
        sin = self.sin[positions.long()].unsqueeze(1)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        k_pages.view(-1, d.num_kv_heads, d.head_dim).index_copy_(0, slots.long(), k.to(k_pages.dtype))
        v_pages.view(-1, d.num_kv_heads, d.head_dim).index_copy_(0, slots.long(), v.to(v_pages.dtype))
        return q.to(k_pages.dtype)

    def decode_step(self, row_slot: torch.Tensor) -> Optional[LinearStep]:
        """What the linear layers read in a decode-only step (each row's slot, the state rows it reads
        and writes), None without them. Flips the rows' state versions: call it once a step."""
        return LinearStep.of(row_slot, self.gdn.states) if self.gdn is not None else None

    def eager_linear_step(self, layout: LinearLayout, data: torch.Tensor, row_slot: torch.Tensor) -> LinearStep:
        """An eager step's `LinearStep` from its layout's array on the device (`linear_layout`)."""
        assert self.gdn is not None, "a layout exists only for a decoder with linear layers"
        return layout.on_device(data, row_slot, self.gdn.states)

    def linear_layout(self, packed: PackedStep) -> Optional[LinearLayout]:
        """An eager step's host layout for the linear layers; None without them or when every row
        holds one token (then `decode_step` serves)."""
        if self.gdn is None:
            return None
        return linear_layout(packed.qo_indptr.numpy(), self.dims.conv_kernel)

    def _attention(self, index: int, layer, h: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                   attend: Attend, row_norm: Optional[kernels.RowNorm] = None,
                   into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A full-attention layer's output (before a tensor-parallel reduce); `index` among the full
        layers. The qwen3_5 style's q_proj gives [query | gate] per head; the gate multiplies the
        output by its sigmoid. With the layer's norm folded (`_folded_layer`): h is the residual
        stream, `row_norm` its norm's scale, and the output is added into `into`."""
        d = self.dims
        n = h.shape[0]
        attn = layer.self_attn
        num_q, num_kv = d.num_qo_heads * d.head_dim, d.num_kv_heads * d.head_dim
        q_width = num_q * (2 if attn.is_gated else 1)
        qkv = self.qkv[index](h)
        gate = None
        if attn.is_gated:
            q, gate = qkv[:, :q_width].view(n, d.num_qo_heads, 2 * d.head_dim).split(d.head_dim, dim=-1)
        else:
            q = qkv[:, :num_q].view(n, d.num_qo_heads, d.head_dim)
        k = qkv[:, q_width:q_width + num_kv].view(n, d.num_kv_heads, d.head_dim)
        v = qkv[:, q_width + num_kv:].view(n, d.num_kv_heads, d.head_dim)
        k_pages, v_pages = self.kv.pages(index)
        q = self._rope_write(q, k, v, positions, write_slots, k_pages, v_pages, attn, row_norm)
        out = attend(index, q, k_pages, v_pages).reshape(n, -1)
        if gate is not None and self.is_fused:  # one kernel for the strided gate's copy, sigmoid and product
            out = kernels.sigmoid_gate(out, gate, row_norm)
        elif gate is not None:
            out = out * torch.sigmoid(gate.reshape(n, -1))
        o = self.o[index]
        return o(out.to(h.dtype)) if into is None else o.accumulate(into, out.to(h.dtype))

    def _mlp(self, index: int, h: torch.Tensor, row_norm: Optional[kernels.RowNorm] = None,
             into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """SwiGLU's output (before a tensor-parallel reduce). A method of its own so that its
        intermediates (gate/up, 8x the hidden width) are freed on return: held by names of the
        layer loop, they stayed alive into the next layer, two layers' worth at its peak. With the
        norm folded: h is the residual stream, `row_norm` its norm's scale, the output added into `into`."""
        gate_up = self.gate_up[index](h)
        down = self.down[index]
        few_rows = down.few_rows_for(gate_up.shape[0]) if row_norm is None else None
        if few_rows is not None:  # silu(gate) * up inside down's operand load (skinny_products)
            return few_rows(gate_up, gated=True)
        if self.is_fused:
            act = kernels.silu_mul(gate_up, row_norm)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        del gate_up
        return down(act) if into is None else down.accumulate(into, act)

    def _folded_layer(self, index: int, layer, x: torch.Tensor, h: Optional[torch.Tensor], positions: torch.Tensor,
                      write_slots: torch.Tensor, attend: Attend, linear: LinearStep | LinearCut | None) -> None:
        """Layer `index` with its norms folded into the products after them (`fold_norms`): the
        products read the residual stream x, the kernels after them scale each row by its norm, and
        the mixer's and the MLP's last products add into x in place. A gated delta-net layer's
        kernels take its input norm's scale only in a decode step (`GdnForward.takes_row_norm`);
        elsewhere in_proj reads the norm of x, its weight now the identity: h, the first layer's,
        when the embedding's kernel made it."""
        input_norm = kernels.RowNorm(x, layer.input_layernorm.eps)
        if layer.is_full:
            self._attention(self.kind_index[index], layer, x, positions, write_slots, attend, input_norm, into=x)
        else:
            assert self.gdn is not None and linear is not None, "a step of a hybrid decoder carries its rows' slots"
            if self.gdn.takes_row_norm(linear):
                self.gdn(self.kind_index[index], x, linear, into=x, row_norm=input_norm)
            else:
                h = self._norm(x, None, layer.input_layernorm)[1] if h is None else h
                self.gdn(self.kind_index[index], h, linear, into=x)
        self._mlp(index, x, kernels.RowNorm(x, layer.post_attention_layernorm.eps), into=x)

    def _embed(self, ids: torch.Tensor, fed: Optional[tuple[torch.Tensor, torch.Tensor]], norm
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, the first layer's norm of x): the tokens' embeddings, each id first read from the
        device token table where `fed` says so. Fused where the table is the process's own: one
        kernel for what took eight or so (`kernels.embed_rmsnorm`)."""
        table = self.model.local_embedding()
        if self.is_fused and table is not None and table.stride(1) == 1:  # the kernel reads whole rows
            src, loop_tokens = fed if fed is not None else (None, None)
            return kernels.embed_rmsnorm(ids, src, loop_tokens, table, norm.weight, norm.eps, norm.is_zero_centred)
        if fed is not None:
            ids = fed_ids(ids, *fed)
        # a tensor-parallel rank's embeds its vocabulary slice, then all-reduces
        return self._norm(self.model.embed_tokens(ids), None, norm)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                 last_index: torch.Tensor, attend: Attend, linear: LinearStep | LinearCut | None = None,
                 fed: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """linear: the step's rows for the gated delta-net layers (`decode_step`, or an eager
        step's `linear_layout(...).on_device(...)`; a piecewise capture's `LinearCut`), None for a
        plain decoder. fed: (token_src, loop_tokens) of a packed step: a token whose source is a
        slot of the device token table reads its id there (`packing.fed_ids`)."""
        model = self.model
        layers = model.model.layers
        x, h = self._embed(ids, fed, layers[0].input_layernorm)
        delta = None
        probes = self.is_fused and launch_probe.extra_launches() > 0  # the launch probe's what-if
        for index, layer in enumerate(layers):
            if self.folds_norms:  # x moves on in place; no delta
                self._folded_layer(index, layer, x, h if index == 0 else None, positions, write_slots, attend, linear)
                if probes:
                    launch_probe.after_layer(x)
                continue
            if delta is not None:  # the first layer's norm came with the embedding
                x, h = self._norm(x, delta, layer.input_layernorm)
            if layer.is_full:
                mixed = self._attention(self.kind_index[index], layer, h, positions, write_slots, attend)
            else:
                assert self.gdn is not None and linear is not None, "a step of a hybrid decoder carries its rows' slots"
                mixed = self.gdn(self.kind_index[index], h, linear)
            delta = model.reduce_partial(mixed)
            x, h = self._norm(x, delta, layer.post_attention_layernorm)
            delta = model.reduce_partial(self._mlp(index, h))
            if probes:
                launch_probe.after_layer(x)
        assert delta is not None or self.folds_norms, "a decoder has at least one layer"
        last = self._final_states(x, delta, last_index)
        return model.gather_vocab(F.linear(last, model.lm_head.weight))

    def _final_states(self, x: torch.Tensor, delta: Optional[torch.Tensor], last_index: torch.Tensor) -> torch.Tensor:
        """The final norm of the rows' last positions, and of every position into `hidden` where a
        prompt's log-probabilities want them (`keep_hidden`, `hidden_into`)."""
        if self.keep_hidden or self.hidden_into is not None:
            self.hidden = self._final_norm(x, delta, out=self.hidden_into)
            if self.is_fused:
                # The fused kernel moved the residual stream on in place (x += delta) as it normed
                # every position: adding delta again put the logits at norm(x + 2 delta), a wrong
                # token for every step that kept its states.
                delta = None
        return self._final_norm(x, delta, rows=last_index)  # the rows' last positions only

    def _final_norm(self, x: torch.Tensor, delta: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The residual add and the final norm of the positions `rows` (every position: None), into
        `out` when given: one kernel where the fused kernels run (gathering `rows`), so every
        position's states and the last positions' the logits come from are the same numbers."""
        norm = self.model.model.norm
        if self.is_fused:
            return kernels.add_rmsnorm(x, delta, norm.weight, norm.eps, norm.is_zero_centred, rows=rows, out=out)
        summed = x if delta is None else x + delta
        normed = norm(summed if rows is None else summed[rows.long()])
        return normed if out is None else out.copy_(normed)

    def named_products(self) -> list[tuple[str, products.Product]]:
        """Every matrix product a step runs but the LM head (the model's own), by role, one a layer."""
        named = [("q/k/v", p) for p in self.qkv] + [("o", p) for p in self.o]
        named += [("gate/up", p) for p in self.gate_up] + [("down", p) for p in self.down]
        if self.gdn is not None:
            named += [("linear in", p) for p in self.gdn.in_proj] + [("linear out", p) for p in self.gdn.out_proj]
        return named

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states (`hidden` kept by an eager step: `keep_hidden`)."""
        return self.model.gather_vocab(F.linear(hidden, self.model.lm_head.weight))

    def greedy(self, logits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's argmax (the first index of its maximum; into `out` when given): one fused pair
        of kernels where the fused kernels run (`kernels.argmax_rows`), torch's reduction elsewhere."""
        if self.is_fused:
            return kernels.argmax_rows(logits, out)
        return logits.argmax(-1) if out is None else torch.argmax(logits, dim=-1, out=out)


def torch_attend(qo_indptr: list[int], kv_indptr: list[int], kv_indices: torch.Tensor,
                 last_page_len: list[int], page_size: int, scale: float) -> Attend:
    """Causal paged attention in torch over FlashInfer's CSR arrays (the CPU stand-in for tests):
    query j of a row with q new tokens over kv_len keys sees keys 0..kv_len-q+j."""
    def attend(_layer: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(q)
        group = q.shape[1] // k_pages.shape[2]
        for row in range(len(qo_indptr) - 1):
            start, end = qo_indptr[row], qo_indptr[row + 1]
            pages = kv_indices[kv_indptr[row]:kv_indptr[row + 1]].long()
            if end == start or pages.numel() == 0:
                continue
            kv_len = (pages.numel() - 1) * page_size + last_page_len[row]
            keys = k_pages[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
            values = v_pages[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q[start:end].float(), keys.float()) * scale
            query_pos = torch.arange(end - start, device=q.device).unsqueeze(1) + kv_len - (end - start)
            scores = scores.masked_fill(torch.arange(kv_len, device=q.device).unsqueeze(0) > query_pos, float("-inf"))
            out[start:end] = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), values.float()).to(q.dtype)
        return out

    return attend
