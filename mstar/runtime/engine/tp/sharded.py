"""One tensor-parallel rank's decoder: the `Decoder` built from the rank's local dims, plus the
collectives that make its outputs the full model's.

In: a `ShardLayout` (which part of each weight this rank holds) and a `TpComm` (its group). Out:
`ShardedDecoder`, a `Decoder` with the same calls the runners use (`embed_tokens`, `forward`,
`logits`, `embed_latents`, `velocity`), so `DecoderRunner` drives it unchanged: its KV cache and
recurrent states are sized from the local dims, so each rank keeps only its own heads' K/V and
states. Every rank of the group must make the same calls in the same order (they run the same
steps): each `embed_tokens`, each layer's mixer and MLP, and each `logits` is a collective.

What crosses ranks: the embedding lookup (each rank embeds the ids in its vocabulary slice, zero
elsewhere, then an all-reduce), the row-parallel outputs of every layer's mixer and MLP (an
all-reduce each, `Decoder.reduce_partial`), and the logits (an all-gather of each rank's slice,
then the padding columns dropped). Hidden states between layers are therefore whole on every rank,
so norms, the image-flow head and sampling run the same everywhere and give the same tokens.
"""
from __future__ import annotations

from typing import Optional

import torch

from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.tp.comm import TpComm
from mstar.runtime.engine.tp.layout import ShardLayout


class ShardedDecoder(Decoder):
    is_sharded = True

    def __init__(self, layout: ShardLayout, comm: TpComm):
        super().__init__(layout.local_dims)
        if (comm.rank, comm.size) != (layout.rank, layout.size):
            raise ValueError(f"the layout is for rank {layout.rank} of {layout.size} but the process group "
                             f"gives rank {comm.rank} of {comm.size}")
        self.layout = layout
        self.comm = comm
        self.full_vocab = layout.dims.vocab

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (taken modulo the full vocabulary) -> `[T, hidden]`, summed over the ranks'
        vocabulary slices (each id is in exactly one)."""
        local = token_ids.long() % self.full_vocab - self.layout.vocab_start
        is_mine = (local >= 0) & (local < self.dims.vocab)
        embedded = self.model.embed_tokens(torch.where(is_mine, local, torch.zeros_like(local)))
        return self.comm.all_reduce(embedded.masked_fill(~is_mine.unsqueeze(-1), 0.0))

    def local_embedding(self) -> Optional[torch.Tensor]:
        return None  # each rank holds a slice of the vocabulary: `embed_tokens` sums them

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits `[R, vocab / size]` -> `[R, vocab]`: every rank's slice, gathered,
        without the padding columns."""
        return self.comm.all_gather_last(logits)[:, :self.full_vocab]

    def reduce_partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x)
