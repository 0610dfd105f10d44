"""A request's state on one kv node, out of one engine and into another (prefill/decode split).

In: a `DecoderRunner` and the request's `RequestState` on the sending rank. Out: `export_kv` ->
(a JSON-able header, tensors): every KV sequence of the request (label, tokens written, then K and
V of every full-attention layer at its positions, `[tokens, kv_heads, head_dim]`; read from the
host pool where KV offload moved them, kv/offload.py), its recurrent
state slot when the node has linear layers (conv and ssm state per layer), and the request's
per-node counters the node's next step reads (tokens fed, tokens sampled, the last sampled token,
stream items decoded). `import_kv` on the receiving rank admits the request on its pool by the
same start budget a single rank uses (kv/admission.py), reserves pages, writes the positions and
restores the counters; it answers the reason when the pool or the slots cannot hold the request
now (nothing changes; the row is held and the transfer retried). The sender keeps its copy until
`drop_kv` (after the receiver ran the request), so a failed transfer loses nothing.

Each rank of a tensor-parallel instance sends its own shard (its KV heads) to the rank at the same
position of the receiving instance.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from mstar.runtime.engine.kv.admission import PageNeed
from mstar.runtime.engine.kv.cache import KvCache
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.runners.request_state import RequestState


class TransferError(ValueError):
    """The node's KV cannot move between ranks (the message says why)."""


def _check_layout(runner: DecoderRunner) -> KvCache:
    if type(runner) is not DecoderRunner or type(runner.cache) is not KvCache:
        raise TransferError(f"node {runner.node.name}: moving KV pages between ranks needs the paged KV layout of "
                            f"the reference runner, not {type(runner).__name__} (run with --attention torch)")
    return runner.cache


def export_kv(runner: DecoderRunner, state: RequestState) -> tuple[dict[str, Any], list[torch.Tensor]]:
    cache, node, request_id = _check_layout(runner), runner.node.name, state.request_id
    sequences: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    if runner.offload is not None and runner.offload.is_offloaded(request_id):
        sequences, tensors = _offloaded_kv(runner, cache, request_id)
    for label in runner.pool.labels_of(request_id):
        key = (request_id, label)
        num_tokens = runner.pool.num_tokens(key)
        flat = cache.flat_positions(runner.pool.page_table(key), num_tokens)
        sequences.append([label, num_tokens])
        for k, v in zip(cache.k, cache.v):
            tensors.extend((k[flat], v[flat]))
    slot = runner.slots.slot_of(request_id) if runner.slots else None
    if slot is not None and runner.states is not None:
        current = runner.states.current(slot)  # the slot's current copy (a runner that runs ahead keeps two)
        tensors.extend(conv[current] for conv in runner.states.conv)
        tensors.extend(ssm[current] for ssm in runner.states.ssm)
    header = {"sequences": sequences, "has_state": slot is not None,
              "history": state.history.get(node, []), "num_sampled": state.num_sampled.get(node, 0),
              "sampled": state.sampled.get(node, []),
              "last_token": state.last_token.get(node), "num_items_seen": state.num_items_seen.get(node, 0)}
    return header, tensors


def _offloaded_kv(runner: DecoderRunner, cache: KvCache, request_id: str
                  ) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """The sequences of a request that KV offload moved to the host pool (its device pool holds
    none of them then), read from the host pages in `export_kv`'s layout. Host pages hold the
    device pages' size, so a sequence's host page list places its positions as a page table does."""
    assert runner.offload is not None and runner.host is not None
    host, num_layers = runner.host.host, len(cache.k)
    sequences: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    for seq in runner.offload.offloaded[request_id]:
        flat = cache.flat_positions(seq.host_pages, seq.num_tokens)
        sequences.append([seq.label, seq.num_tokens])
        for layer in range(num_layers):
            keys, values = host[layer], host[num_layers + layer]  # `page_tensors`' order: keys, then values
            tensors.extend((keys.flatten(0, 1)[flat], values.flatten(0, 1)[flat]))
    return sequences, tensors


def import_kv(runner: DecoderRunner, state: RequestState, header: dict[str, Any],
              tensors: list[torch.Tensor]) -> Optional[str]:
    """None when the request now lives here; else why it cannot yet (nothing changed)."""
    cache, pool, request_id = _check_layout(runner), runner.pool, state.request_id
    sequences = [(str(label), int(num)) for label, num in header["sequences"]]
    needs_slot = bool(header["has_state"]) and runner.slots is not None and runner.slots.slot_of(request_id) is None
    need = PageNeed(request_id, sum(pool.pages_for(num) for _, num in sequences),
                    0 if runner.admission.is_started(request_id) else runner.start_budget_pages(state), needs_slot)
    if runner.refused([need]):
        return (f"node {runner.node.name}: no room for the request's {need.num_pages} KV pages "
                f"(start budget {need.budget_pages}) on this rank yet")
    runner.admission.grant(need)
    parts = iter(tensors)
    for label, num_tokens in sequences:
        key = (request_id, label)
        if not pool.reserve(key, num_tokens):
            raise RuntimeError(f"KV pages vanished between the check and the import of {request_id}")
        flat = cache.flat_positions(pool.page_table(key), num_tokens)
        for k, v in zip(cache.k, cache.v):
            k[flat] = next(parts).to(k.dtype)
            v[flat] = next(parts).to(v.dtype)
        pool.commit(key, num_tokens)
    if needs_slot and runner.slots is not None and runner.states is not None:
        slot = runner.slots.acquire(request_id)
        assert slot is not None, "the admission check counted a free slot"
        runner.states.clear(slot)  # its first copy made current, which the tensors fill
        for conv in runner.states.conv:
            conv[slot] = next(parts)
        for ssm in runner.states.ssm:
            ssm[slot] = next(parts)
    _restore_counters(runner.node.name, state, header)
    return None


def _restore_counters(node: str, state: RequestState, header: dict[str, Any]) -> None:
    state.history[node] = [int(t) for t in header["history"]]
    state.num_sampled[node] = int(header["num_sampled"])
    if header.get("sampled"):
        state.sampled[node] = [int(t) for t in header["sampled"]]
    state.num_items_seen[node] = int(header["num_items_seen"])
    if header["last_token"] is not None:
        state.last_token[node] = [int(t) for t in header["last_token"]]


def drop_kv(runner: DecoderRunner, request_id: str) -> None:
    """The receiver runs the request now: free the sender's pages, budget and slot."""
    runner.end_request(request_id)
