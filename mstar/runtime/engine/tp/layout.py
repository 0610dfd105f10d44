"""Which part of every decoder parameter a tensor-parallel rank holds.

In: the full model's `DecoderDims`, the rank inside its TP group and the group's size. Out: a
`ShardLayout` with the rank's `local_dims` (the dims its `Decoder` modules are built from: heads,
intermediate width and vocabulary divided by the group size) and, per parameter name, a `Shard`
saying how to cut the full tensor (`take`, which reads a torch tensor or a safetensors slice, so
a checkpoint is sliced without ever reading the full tensor).

The split (Megatron's, as vLLM does it):
- column-parallel (rows of the weight, per head or per channel): q/k/v of full attention
  (Qwen3.5's q_proj with its per-head gate), gate/up of the MLP, the gated delta-net's
  in_proj_qkv (its q, k and v head ranges), in_proj_z/b/a, conv1d, A_log and dt_bias;
- row-parallel (columns of the weight): o_proj, down_proj, out_proj; their partial outputs are
  summed across ranks (`TpComm.all_reduce`), and their bias is held by rank 0 only (the other ranks
  hold zeros), so the sum adds it once;
- vocabulary-parallel: the embedding and the LM head, `ceil(vocab / size)` rows each (the last
  rank's tail is zero padding). Replicating them would leave a third of Qwen3.5-0.8B's weights
  (248k x 1024) and a fifth of Llama-3.2-1B's on every rank, against the point of TP (memory per
  rank); the cost is one all-reduce of the embedded tokens and one all-gather of the logits a step.
- replicated: norms (including q/k norms and the gated norm) and the image-flow head.
KV heads: each rank holds `kv_heads / size`; with fewer kv heads than ranks and `size` a multiple
of them, each kv head is replicated on `size / kv_heads` consecutive ranks (the ranks whose query
heads read it); any other shape is refused (`TpError`), as are heads or widths that do not divide.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from mstar.plan.dims import DecoderDims, DimsError, tp_split_problem

Range = tuple[int, int]


class TpError(DimsError):
    """The model cannot be split over this many ranks (the message says which dim and why)."""


@dataclass(frozen=True)
class Shard:
    """`cut`: the listed ranges of axis `axis`, concatenated, zero-padded to `size` along it;
    `whole`: the full tensor; `first_rank`: the full tensor on rank 0, zeros on the others."""

    kind: Literal["cut", "whole", "first_rank"]
    axis: int = 0
    ranges: tuple[Range, ...] = ()
    size: int = 0


WHOLE = Shard("whole")


def _heads(rank: int, num_per_rank: int, width: int) -> Range:
    return rank * num_per_rank * width, (rank + 1) * num_per_rank * width


@dataclass(frozen=True)
class ShardLayout:
    dims: DecoderDims  # the full model's
    rank: int
    size: int
    node: str = "decoder"  # for messages only

    def __post_init__(self) -> None:
        problem = tp_split_problem(self.dims, self.size)
        if problem:
            raise TpError(f"node {self.node}: cannot split the model over {self.size} tensor-parallel ranks: "
                          f"{problem}")
        if not 0 <= self.rank < self.size:
            raise TpError(f"node {self.node}: rank {self.rank} is outside a group of {self.size}")

    @property
    def vocab_chunk(self) -> int:
        return -(-self.dims.vocab // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_chunk

    @property
    def num_local_kv_heads(self) -> int:
        return max(self.dims.num_kv_heads // self.size, 1)

    @property
    def kv_head_start(self) -> int:
        """The first kv head this rank holds (with replication, the one its query heads read)."""
        d = self.dims
        if d.num_kv_heads >= self.size:
            return self.rank * self.num_local_kv_heads
        return self.rank // (self.size // d.num_kv_heads)

    @property
    def local_dims(self) -> DecoderDims:
        d, n = self.dims, self.size
        return replace(d, num_qo_heads=d.num_qo_heads // n, num_kv_heads=self.num_local_kv_heads,
                       intermediate=d.intermediate // n, vocab=self.vocab_chunk,
                       num_linear_heads=d.num_linear_heads // n if d.has_linear_layers else d.num_linear_heads,
                       num_linear_value_heads=(d.num_linear_value_heads // n if d.has_linear_layers
                                               else d.num_linear_value_heads))

    def shard_of(self, name: str) -> Shard:
        """How parameter `name` (a `Decoder` parameter path) is cut for this rank."""
        module, _, leaf = name.rpartition(".")
        parts = module.split(".")
        owner, parent = parts[-1], (parts[-2] if len(parts) > 1 else "")
        if owner in ("embed_tokens", "lm_head"):
            start = self.vocab_start
            return Shard("cut", 0, ((start, min(start + self.vocab_chunk, self.dims.vocab)),), self.vocab_chunk)
        if parent == "self_attn":
            return self._attention(owner, leaf)
        if parent == "mlp":
            return self._mlp(owner, leaf)
        if owner == "linear_attn" or parent == "linear_attn":
            return self._linear(owner if parent == "linear_attn" else leaf)
        return WHOLE

    def _cut(self, axis: int, *ranges: Range) -> Shard:
        return Shard("cut", axis, ranges, sum(end - start for start, end in ranges))

    def _attention(self, owner: str, leaf: str) -> Shard:
        d, local = self.dims, self.local_dims
        if owner == "q_proj":
            width = d.head_dim * (2 if d.style == "qwen3_5" else 1)  # qwen3_5: [query | gate] per head
            return self._cut(0, _heads(self.rank, local.num_qo_heads, width))
        if owner in ("k_proj", "v_proj"):
            start = self.kv_head_start * d.head_dim
            return self._cut(0, (start, start + local.num_kv_heads * d.head_dim))
        if owner == "o_proj":
            return self._row_parallel(leaf, _heads(self.rank, local.num_qo_heads, d.head_dim))
        return WHOLE  # q_norm, k_norm

    def _mlp(self, owner: str, leaf: str) -> Shard:
        width = self.local_dims.intermediate
        if owner in ("gate_proj", "up_proj"):
            return self._cut(0, _heads(self.rank, 1, width))
        return self._row_parallel(leaf, _heads(self.rank, 1, width))

    def _linear(self, owner: str) -> Shard:
        """A gated delta-net parameter (`owner`: its module, or the parameter itself for A_log and dt_bias)."""
        d, local = self.dims, self.local_dims
        keys = _heads(self.rank, local.num_linear_heads, d.linear_key_dim)
        values = _heads(self.rank, local.num_linear_value_heads, d.linear_value_dim)
        if owner in ("in_proj_qkv", "conv1d"):  # channels [q | k | v], each cut by heads
            key_width = d.num_linear_heads * d.linear_key_dim
            return self._cut(0, keys, (keys[0] + key_width, keys[1] + key_width),
                             (values[0] + 2 * key_width, values[1] + 2 * key_width))
        if owner == "in_proj_z":
            return self._cut(0, values)
        if owner in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
            return self._cut(0, _heads(self.rank, local.num_linear_value_heads, 1))
        if owner == "out_proj":
            return self._cut(1, values)
        return WHOLE  # the gated norm's weight (per value-head dim)

    def _row_parallel(self, leaf: str, columns: Range) -> Shard:
        return Shard("first_rank") if leaf == "bias" else self._cut(1, columns)

    def take(self, name: str, source: Any, full_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of parameter `name` from `source`, the full tensor: a torch tensor or
        a safetensors slice (`get_slice`), read range by range."""
        shard = self.shard_of(name)
        if shard.kind == "whole" or (shard.kind == "first_rank" and self.rank == 0):
            return source[:]
        if shard.kind == "first_rank":
            return torch.zeros(full_shape)
        lead = (slice(None),) * shard.axis
        parts = [source[lead + (slice(start, end),)] for start, end in shard.ranges]
        out = torch.cat(parts, dim=shard.axis) if len(parts) > 1 else parts[0]
        missing = shard.size - out.shape[shard.axis]
        if missing:  # the vocabulary's padding rows on the last rank
            pad = list(out.shape)
            pad[shard.axis] = missing
            out = torch.cat([out, out.new_zeros(pad)], dim=shard.axis)
        return out
