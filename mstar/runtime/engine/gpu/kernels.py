"""Fused Triton kernels of the device step: one launch where torch needs five to a dozen.

In and out (all on one device; activations in the model dtype, bf16 on a GPU):
- `add_rmsnorm(x, delta, weight, eps, is_zero_centred, rows)`: `x += delta` in place (when `delta`
  is given), then returns RMSNorm(x) `[N, H]`, the same rounding as `layers.RMSNorm` (normalised in
  fp32, cast, then times the weight; zero-centred: times 1 + w in fp32). With `rows` (`[R]` indices
  into x) only those rows, gathered, `[R, H]`, x left as it is (the final norm of each row's last
  token: no gather kernels before it).
- `embed_rmsnorm(ids, token_src, loop_tokens, table, weight, eps, is_zero_centred)`: each token's
  id (from the device token table `loop_tokens[token_src]` where `token_src >= 0`, as
  `packing.fed_ids`; modulo the table's rows, as `Decoder.embed_tokens`), its embedding row as the
  residual stream x `[N, H]`, and RMSNorm(x): (x, normed). A step's first eight or so torch kernels
  (casts, the clamp, the table's gather, the select, the modulo, the embedding, the first norm) in one.
- `rope_write_kv(q, k, v, cos, sin, positions, slots, k_cache, v_cache, rotary)`: q `[N, Hq, D]`,
  k and v `[N, Hkv, D]` (views with any token stride, heads contiguous); rotates the first
  `rotary` dims of q and k by the fp32 cos/sin tables `[positions, rotary/2]` at each token's
  position (Hugging Face's rotate_half, computed in fp32), writes k and v into the cache at each
  token's flat slot (`[slots, Hkv, D]` views of the pages) and returns the rotated q `[N, Hq, D]`.
  With `qk_norm` (`QkNorm`) q and k are first RMS-normed per head as `layers.RMSNorm` does (q may
  then be a view with any head stride: the [query | gate] heads of Qwen3.5's q_proj). With
  `row_norm` (`RowNorm`) q, k and v are first multiplied by each token's RMSNorm scale of the
  residual stream (`norm_folding.py`: the norm before q/k/v folded into their product).
- `sigmoid_gate(x, gate)`: `[N, H*D]` times sigmoid(gate) `[N, H, D]` (a strided view), with torch's
  bf16 rounding (Qwen3.5's gated attention output); with `row_norm`, the gate first times each
  token's RMSNorm scale (as `rope_write_kv`).
- `silu_mul(gate_up, row_norm)`: `[N, 2I] -> [N, I]`, silu(gate) * up with torch's bf16 rounding;
  with `row_norm`, gate and up first times each row's RMSNorm scale (as `rope_write_kv`).
- `argmax_rows(logits)`: `[N, V] -> [N]` int64, the first index of each row's largest value (as
  `torch.argmax`), in two launches: the maxima of `ARGMAX_CHUNK`-wide chunks of every row, then
  each row's first chunk holding its maximum. torch's reduction gave one row one block of 512
  threads: 28.5 us for Llama-3.2-1B's 128,256 logits on the H200, 39 us for 64 rows.

Why: a decode step of a 16-layer model launched about 40 kernels a layer (RoPE in fp32 with
slices and a cat, casts, the norm's mean and rsqrt, two index copies); in a CUDA graph each costs a
few microseconds whatever its size, which dominated the step at small batches.

Programmatic dependent launch (PDL): on a Hopper or newer GPU each kernel is launched with PDL and
waits for its predecessor's writes with `gdc_wait` before its first load of step data, then lets
its successor launch (`gdc_launch_dependents`), so inside a CUDA graph the next kernel's launch
overlaps this one's tail instead of following its completion (FlashInfer's kernels do the same on
sm_90). A kernel before the wait may only read what no kernel of the step writes. `set_pdl(False)`
turns it off (`mstar bench engine --no-pdl`, the what-if beside it).

`available(device)` says whether these run there (a CUDA device with Triton); elsewhere the
forward keeps its torch ops. Tests run them under the Triton interpreter on the CPU
(`TRITON_INTERPRET=1` when this module is imported).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton keep the torch ops
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


_pdl_allowed = True


def set_pdl(enabled: bool) -> None:
    """Launch with programmatic dependent launch where the device has it (module docstring), or
    never; kernels launched (and graphs captured) afterwards follow it."""
    global _pdl_allowed
    _pdl_allowed = enabled
    _device_has_pdl.cache_clear()


@functools.lru_cache(maxsize=None)
def _device_has_pdl(device: torch.device) -> bool:
    return (_pdl_allowed and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"))


def pdl_launch(tensor: torch.Tensor) -> dict[str, Any]:
    """The launch's PDL arguments: the kernels' `PDL` constexpr, and Triton's `launch_pdl` only
    when on (the interpreter knows no such option)."""
    if _device_has_pdl(tensor.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@dataclass
class QkNorm:
    """The per-head RMSNorms of q and k that `rope_write_kv` applies before rotating (Qwen3's and
    Qwen3.5's q_norm and k_norm: one weight `[D]` each, one eps, plain or zero-centred)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    is_zero_centred: bool


@dataclass
class RowNorm:
    """The residual stream `x` `[N, H]` whose RMSNorm a kernel applies as a per-row scale,
    rsqrt(mean(x^2) + eps), to a product's output (the norm's weight folded into the product's
    weight: `norm_folding.py`); eps is the norm's."""

    x: torch.Tensor
    eps: float


def row_norm_args(row_norm: Optional[RowNorm], like: torch.Tensor) -> dict[str, Any]:
    """A kernel's row-norm arguments: the residual rows, their stride and width, eps and the
    `HAS_ROW_NORM` / `BLOCK_X` constexprs (a dummy pointer and one column without a norm)."""
    if row_norm is None:
        return {"x_ptr": like, "stride_x": 0, "num_x_cols": 1, "row_eps": 0.0, "HAS_ROW_NORM": False, "BLOCK_X": 1}
    x = row_norm.x
    if x.stride(1) != 1:
        raise ValueError("row_norm: the residual stream must have contiguous columns")
    return {"x_ptr": x, "stride_x": x.stride(0), "num_x_cols": x.shape[1], "row_eps": row_norm.eps,
            "HAS_ROW_NORM": True, "BLOCK_X": triton.next_power_of_2(x.shape[1])}


if triton is not None:
    @triton.jit
    def arrivals_before(count_ptr, NUM: tl.constexpr):
        """How many of the `NUM` programs sharing the counter at `count_ptr` counted in before this
        one (0 to NUM-1: the one that gets NUM-1 is the last, and may read what all the others
        stored). The first barrier puts every thread's stores before the counter's increment (one
        thread's atomic, release); the second extends that thread's acquire to all the program's
        threads (Triton's broadcast of a scalar atomic's result syncs them too, but that is its
        lowering, not its semantics), so the others' stores are visible to every thread of the last.
        The caller sets the counter back to zero once the last is done with it."""
        tl.debug_barrier()
        if NUM == 1:
            arrived = 0
        else:
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
            tl.debug_barrier()
        return arrived

    @triton.jit
    def rms_row_scale(x_ptr, row, stride_x, num_cols, eps, BLOCK: tl.constexpr):
        """One row's RMSNorm scale, rsqrt(mean(x^2) + eps), in fp32 (`RowNorm`); read after the
        PDL wait: the residual stream is step data."""
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)

    @triton.jit
    def _norm_weight(w_ptr, num_cols, BLOCK: tl.constexpr):
        """(columns, their mask, the norm's weight in fp32): loaded before a PDL wait, since no
        kernel writes a weight."""
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        return cols, mask, tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _rmsnorm_row(x, w, out_ptr, num_cols, eps, mask, IS_ZERO_CENTRED: tl.constexpr):
        """Stores RMSNorm of one row `x` (x's dtype) at out_ptr, rounded as `layers.RMSNorm`."""
        x32 = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(x32 * x32, axis=0) / num_cols + eps)
        if IS_ZERO_CENTRED:
            out = x32 * scale * (1.0 + w)
        else:
            out = (x32 * scale).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, rows_ptr, stride_x, stride_d, stride_o, num_cols, eps,
                            HAS_DELTA: tl.constexpr, IS_GATHER: tl.constexpr, IS_ZERO_CENTRED: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        index = tl.program_id(0).to(tl.int64)
        cols, mask, w = _norm_weight(w_ptr, num_cols, BLOCK)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if IS_GATHER:
            row = tl.load(rows_ptr + index).to(tl.int64)
        else:
            row = index
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            delta = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if HAS_DELTA:
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
            if not IS_GATHER:  # the residual stream moves on in place; a gather only reads it
                tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
        _rmsnorm_row(x, w, out_ptr + index * stride_o + cols, num_cols, eps, mask, IS_ZERO_CENTRED)

    @triton.jit
    def _embed_rmsnorm_kernel(ids_ptr, src_ptr, loop_ptr, table_ptr, w_ptr, x_ptr, out_ptr, vocab, stride_t,
                              num_cols, eps, HAS_SRC: tl.constexpr, IS_ZERO_CENTRED: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols, mask, w = _norm_weight(w_ptr, num_cols, BLOCK)
        if PDL:
            tl.extra.cuda.gdc_wait()
        token_id = tl.load(ids_ptr + token).to(tl.int64)
        if HAS_SRC:
            src = tl.load(src_ptr + token).to(tl.int64)
            fed = tl.load(loop_ptr + tl.maximum(src, 0)).to(tl.int64)  # slot 0 when unused: always there
            token_id = tl.where(src >= 0, fed, token_id)
        token_id = token_id % vocab
        token_id = tl.where(token_id < 0, token_id + vocab, token_id)  # Python's modulo, as torch's
        x = tl.load(table_ptr + token_id * stride_t + cols, mask=mask, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(x_ptr + token * num_cols + cols, x, mask=mask)
        _rmsnorm_row(x, w, out_ptr + token * num_cols + cols, num_cols, eps, mask, IS_ZERO_CENTRED)

    @triton.jit
    def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, stride_q, stride_qh, stride_k, stride_v, cos_ptr, sin_ptr,
                              stride_cs, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, q_norm_ptr,
                              k_norm_ptr, eps, x_ptr, stride_x, num_x_cols, row_eps, NUM_Q: tl.constexpr,
                              NUM_KV: tl.constexpr, D: tl.constexpr, ROTARY: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, IS_ZERO_CENTRED: tl.constexpr,
                              HAS_ROW_NORM: tl.constexpr, BLOCK_X: tl.constexpr, PDL: tl.constexpr):
        """One program a token, every q and k head of it as the rows of one tile (a program per
        (token, head) of one warp spent most of its time on the dependent loads of its position,
        cos/sin and slot: 13.7 us a layer for a 256-token chunk step on the H200)."""
        token = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        is_dim = d < D
        is_q = h < NUM_Q
        is_k = (h >= NUM_Q) & (h < NUM_Q + NUM_KV)
        kv_head = tl.maximum(h - NUM_Q, 0)
        half = ROTARY // 2
        is_first = d < half
        is_rotated = d < ROTARY
        partner = tl.where(is_first, d + half, d - half)
        freq = tl.where(is_first, d, d - half)
        if PDL:
            tl.extra.cuda.gdc_wait()
        position = tl.load(pos_ptr + token).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        q_base = q_ptr + token * stride_q + h * stride_qh
        k_base = k_ptr + token * stride_k + kv_head * D
        # q rows and k rows from their own tensors (disjoint masks), one tile
        x = (tl.load(q_base + d, mask=is_q & is_dim, other=0.0).to(tl.float32)
             + tl.load(k_base + d, mask=is_k & is_dim, other=0.0).to(tl.float32))
        other = (tl.load(q_base + partner, mask=is_q & is_rotated, other=0.0).to(tl.float32)
                 + tl.load(k_base + partner, mask=is_k & is_rotated, other=0.0).to(tl.float32))
        value = tl.load(v_ptr + token * stride_v + kv_head * D + d, mask=is_k & is_dim, other=0.0)
        cos = tl.load(cos_ptr + position * stride_cs + freq, mask=is_rotated, other=1.0)
        sin = tl.load(sin_ptr + position * stride_cs + freq, mask=is_rotated, other=0.0)
        if HAS_ROW_NORM:  # the norm before q/k/v, folded into their product: its scale here
            row_scale = rms_row_scale(x_ptr, token, stride_x, num_x_cols, row_eps, BLOCK_X)
            x, other = x * row_scale, other * row_scale
            value = value.to(tl.float32) * row_scale
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if HAS_NORM:  # the per-head q/k RMSNorm first, rounded as `layers.RMSNorm` rounds it
            scale = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            w = tl.where(is_q, tl.load(q_norm_ptr + d, mask=is_dim, other=0.0).to(tl.float32),
                         tl.load(k_norm_ptr + d, mask=is_dim, other=0.0).to(tl.float32))
            w_other = tl.where(is_q, tl.load(q_norm_ptr + partner, mask=is_rotated, other=0.0).to(tl.float32),
                               tl.load(k_norm_ptr + partner, mask=is_rotated, other=0.0).to(tl.float32))
            if IS_ZERO_CENTRED:
                x = (x * scale * (1.0 + w)).to(q_out_ptr.dtype.element_ty).to(tl.float32)
                other = (other * scale * (1.0 + w_other)).to(q_out_ptr.dtype.element_ty).to(tl.float32)
            else:
                x = (w * (x * scale).to(q_out_ptr.dtype.element_ty).to(tl.float32))
                other = (w_other * (other * scale).to(q_out_ptr.dtype.element_ty).to(tl.float32))
                x = x.to(q_out_ptr.dtype.element_ty).to(tl.float32)
                other = other.to(q_out_ptr.dtype.element_ty).to(tl.float32)
        rotated = tl.where(is_first, x * cos - other * sin, tl.where(is_rotated, x * cos + other * sin, x))
        tl.store(q_out_ptr + (token * NUM_Q + h) * D + d, rotated.to(q_out_ptr.dtype.element_ty), mask=is_q & is_dim)
        kv_at = (slot * NUM_KV + kv_head) * D + d
        tl.store(k_cache_ptr + kv_at, rotated.to(k_cache_ptr.dtype.element_ty), mask=is_k & is_dim)
        tl.store(v_cache_ptr + kv_at, value.to(v_cache_ptr.dtype.element_ty), mask=is_k & is_dim)

    @triton.jit
    def _sigmoid_gate_kernel(in_ptr, gate_ptr, out_ptr, stride_in, stride_g, stride_gh, x_ptr, stride_x, num_x_cols,
                             row_eps, D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROW_NORM: tl.constexpr,
                             BLOCK_X: tl.constexpr, PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        mask = d < D
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(in_ptr + token * stride_in + head * D + d, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + token * stride_g + head * stride_gh + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROW_NORM:
            gate = gate * rms_row_scale(x_ptr, token, stride_x, num_x_cols, row_eps, BLOCK_X)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # torch rounds sigmoid(gate) to the activation dtype before the product.
        gate = tl.sigmoid(gate).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + token * stride_in + head * D + d, (x * gate).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, x_ptr, stride_x, num_x_cols, row_eps,
                         BLOCK: tl.constexpr, HAS_ROW_NORM: tl.constexpr, BLOCK_X: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        if PDL:
            tl.extra.cuda.gdc_wait()
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROW_NORM:  # the norm before gate/up, folded into their product: its scale here
            row_scale = rms_row_scale(x_ptr, row, stride_x, num_x_cols, row_eps, BLOCK_X)
            gate, up = gate * row_scale, up * row_scale
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # torch rounds silu(gate) to the activation dtype before the product.
        silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def load_chunk(logits_ptr, stride_row, vocab, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """(row, columns, fp32 values) of the program's chunk of a row, (row, chunk) its grid place;
        -inf past the vocabulary. Under PDL, after the predecessor's writes."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        return row, cols, x

    @triton.jit
    def store_chunk_max(best_ptr, index_ptr, num_chunks, row, cols, x, vocab):
        """The chunk's maximum and the first column holding it (torch.argmax's tie rule)."""
        best = tl.max(x, 0)
        first = tl.min(tl.where(x == best, cols, vocab), 0)
        tl.store(best_ptr + row * num_chunks + tl.program_id(1), best)
        tl.store(index_ptr + row * num_chunks + tl.program_id(1), tl.minimum(first, vocab - 1))

    @triton.jit
    def _chunk_argmax_kernel(logits_ptr, stride_row, vocab, best_ptr, index_ptr, num_chunks, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        row, cols, x = load_chunk(logits_ptr, stride_row, vocab, BLOCK, PDL)
        store_chunk_max(best_ptr, index_ptr, num_chunks, row, cols, x, vocab)

    @triton.jit
    def _rows_argmax_kernel(best_ptr, index_ptr, out_ptr, num_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunks = tl.arange(0, BLOCK)
        mask = chunks < num_chunks
        if PDL:
            tl.extra.cuda.gdc_wait()
        best = tl.load(best_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
        top = tl.max(best, 0)
        first_chunk = tl.min(tl.where((best == top) & mask, chunks, num_chunks), 0)
        index = tl.load(index_ptr + row * num_chunks + tl.minimum(first_chunk, num_chunks - 1))
        tl.store(out_ptr + row, index.to(tl.int64))


ARGMAX_CHUNK = 4096  # columns a first-pass program reduces (Llama-3.2-1B: 32 chunks a row)


def add_rmsnorm(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                is_zero_centred: bool = False, rows: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    h = x.shape[1]
    n = x.shape[0] if rows is None else rows.shape[0]
    if out is None:
        out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    elif out.shape != (n, h) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"add_rmsnorm: out must be [{n}, {h}] {x.dtype} with contiguous rows")
    if n == 0:
        return out
    block = triton.next_power_of_2(h)
    _add_rmsnorm_kernel[(n,)](x, delta if delta is not None else x, weight, out, rows if rows is not None else x,
                              x.stride(0), delta.stride(0) if delta is not None else 0, out.stride(0), h, eps,
                              HAS_DELTA=delta is not None, IS_GATHER=rows is not None,
                              IS_ZERO_CENTRED=is_zero_centred, BLOCK=block, num_warps=_norm_warps(block),
                              **pdl_launch(x))
    return out


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def embed_rmsnorm(ids: torch.Tensor, token_src: Optional[torch.Tensor], loop_tokens: Optional[torch.Tensor],
                  table: torch.Tensor, weight: torch.Tensor, eps: float, is_zero_centred: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, RMSNorm(x)) of the step's tokens, x their embedding rows (module docstring); without
    `token_src` and `loop_tokens` every id is the packed one."""
    n, (vocab, h) = ids.shape[0], table.shape
    x = torch.empty((n, h), dtype=table.dtype, device=table.device)
    out = torch.empty_like(x)
    if n == 0:
        return x, out
    if table.stride(1) != 1:
        raise ValueError("embed_rmsnorm: the table's rows must be contiguous")
    block = triton.next_power_of_2(h)
    has_src = token_src is not None and loop_tokens is not None
    _embed_rmsnorm_kernel[(n,)](ids, token_src if has_src else ids, loop_tokens if has_src else ids, table, weight, x,
                                out, vocab, table.stride(0), h, eps, HAS_SRC=has_src, IS_ZERO_CENTRED=is_zero_centred,
                                BLOCK=block, num_warps=_norm_warps(block), **pdl_launch(table))
    return x, out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  rotary: int, qk_norm: Optional[QkNorm] = None, row_norm: Optional[RowNorm] = None) -> torch.Tensor:
    n, num_q, d = q.shape
    num_kv = k.shape[1]
    out = torch.empty((n, num_q, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    if q.stride(2) != 1 or k.stride(2) != 1 or k.stride(1) != d:
        raise ValueError("rope_write_kv: q and k must have contiguous head dims, k contiguous heads")
    q_weight, k_weight = (qk_norm.q_weight, qk_norm.k_weight) if qk_norm is not None else (cos, cos)
    block_h, block_d = triton.next_power_of_2(num_q + num_kv), triton.next_power_of_2(d)
    _rope_write_kv_kernel[(n,)](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), v.stride(0), cos, sin, cos.stride(0), positions, slots, out,
        k_cache, v_cache, q_weight, k_weight, qk_norm.eps if qk_norm is not None else 0.0, NUM_Q=num_q,
        NUM_KV=num_kv, D=d, ROTARY=rotary, BLOCK_H=block_h, BLOCK_D=block_d, HAS_NORM=qk_norm is not None,
        IS_ZERO_CENTRED=qk_norm is not None and qk_norm.is_zero_centred, **row_norm_args(row_norm, q),
        num_warps=max(1, min(8, block_h * block_d // 1024)), **pdl_launch(q))
    return out


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, row_norm: Optional[RowNorm] = None) -> torch.Tensor:
    """x `[N, H*D]` (rows contiguous) times sigmoid(gate) `[N, H, D]` (any token and head stride)."""
    n, num_heads, d = gate.shape
    out = torch.empty_like(x)
    if n == 0:
        return out
    if x.stride(1) != 1 or gate.stride(2) != 1:
        raise ValueError("sigmoid_gate: x and gate must have contiguous columns")
    _sigmoid_gate_kernel[(n, num_heads)](x, gate, out, x.stride(0), gate.stride(0), gate.stride(1), D=d,
                                         BLOCK_D=triton.next_power_of_2(d), **row_norm_args(row_norm, x),
                                         num_warps=1, **pdl_launch(x))
    return out


def silu_mul(gate_up: torch.Tensor, row_norm: Optional[RowNorm] = None) -> torch.Tensor:
    n, double = gate_up.shape
    width = double // 2
    out = torch.empty((n, width), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    block = min(2048, triton.next_power_of_2(width))
    _silu_mul_kernel[(n, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                      BLOCK=block, **row_norm_args(row_norm, gate_up), num_warps=4,
                                                      **pdl_launch(gate_up))
    return out


def argmax_rows(logits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`[N, V]` (columns contiguous) -> `[N]` int64 (into `out` when given): the first index of each
    row's maximum. A row of -inf only gives its first column; a row holding NaN an unspecified one
    (torch: the NaN's)."""
    def first_pass(grid: tuple[int, int], best: torch.Tensor, index: torch.Tensor) -> None:
        _chunk_argmax_kernel[grid](logits, logits.stride(0), logits.shape[1], best, index, grid[1],
                                   BLOCK=ARGMAX_CHUNK, num_warps=8, **pdl_launch(logits))

    return chunked_argmax(logits, first_pass, out)


def chunked_argmax(logits: torch.Tensor, first_pass: Callable[[tuple[int, int], torch.Tensor, torch.Tensor], None],
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`argmax_rows`'s two launches around a first pass of the caller's (`sampling_kernels.draw_rows`
    maximises its draws): `first_pass(grid, best, index)` writes each (row, chunk of ARGMAX_CHUNK
    columns)'s maximum and its first column, `[N, chunks]` fp32 and int32, grid (N, chunks); then
    each row's first chunk holding its maximum gives the row's index."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device) if out is None else out
    if n == 0:
        return out
    if logits.stride(1) != 1:
        raise ValueError("argmax_rows: logits must have contiguous columns")
    num_chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    best = torch.empty((n, num_chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((n, num_chunks), dtype=torch.int32, device=logits.device)
    first_pass((n, num_chunks), best, index)
    _rows_argmax_kernel[(n,)](best, index, out, num_chunks, BLOCK=triton.next_power_of_2(num_chunks), num_warps=1,
                              **pdl_launch(logits))
    return out
