"""A rank other than 0: build the engine for this rank's nodes, then run the controller's commands.

In: the plan, this rank, the engine options (`RankOptions`) and a `Channel` to rank 0. Out: nothing;
the loop answers rank 0 until it says `stop`:

    add_request {request_id, request}  -> added {reason}
    claim_prefix {request_id, node, tokens} -> claimed {num_tokens}
    end_request {request_id}           end_node {request_id, node}
    step {step}                        -> result {result, imported} on the step's leader,
                                          done {imported} on a TP follower, step_error {message}
    kv_send {request_id, node, dst}    kv_recv {request_id, node, src}    kv_drop {request_id, node}
    stop

Anything this rank cannot handle (a bug, a lost peer) is sent as `fatal {message}` before the
process exits non-zero, so rank 0 names the cause.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mstar.plan.schema import Plan
from mstar.runtime.engine import gpu_switches
from mstar.runtime.serve.ranks.channel import Channel, Message
from mstar.runtime.serve.ranks.executor import RankExecutor
from mstar.runtime.serve.ranks.wire import decode_request, decode_step, encode_result

Reply = Optional[tuple[str, dict[str, Any], list]]


@dataclass
class RankOptions:
    """The torch engine's options (`mstar run`'s --dims, --weights, --seed, --kv-pages, --device,
    --attention, --no-blas-pdl, --nucleus, --penalties) and the rank timeout, as plain data for every rank."""

    dims: str = "tiny"
    weights: Optional[list[str]] = None
    seed: int = 0
    kv_pages: Optional[int] = None
    device: str = "cpu"
    attention: str = "auto"
    timeout_s: float = 8.0
    plan_path: Optional[str] = None  # where the plan was read: its generated glue sits beside it
    blas_pdl: bool = True  # the graphs' edges into cuBLAS's products programmatic (--no-blas-pdl: False)
    nucleus: Optional[str] = None  # how the device sampler finds a nucleus (--nucleus; None: sampler.NUCLEUS)
    penalties: Optional[str] = None  # how a GPU applies penalties (--penalties; None: penalties.PENALTIES)

    def shared(self) -> dict[str, Any]:
        """The options every rank must run with alike (rank 0 compares them at start-up): each
        rank builds its shard and its pool from them, so a TP shard from another seed or dims gives
        other tokens and another pool size holds other rows, and the ranks' collectives no longer
        meet. The weights' folder and the timeout may differ between hosts."""
        return {"dims": self.dims, "seed": self.seed, "kv_pages": self.kv_pages, "attention": self.attention,
                "device": self.device.split(":")[0], "weights": weights_nodes(self.weights), "blas_pdl": self.blas_pdl}


def weights_nodes(weights: Optional[list[str]]) -> list[str]:
    """The nodes `--weights` entries name (`NODE=DIR`; `*` for a bare DIR): which nodes load a
    checkpoint, not from where (a folder's path may differ between hosts)."""
    return sorted({entry.split("=", 1)[0] if "=" in entry else "*" for entry in weights or []})


def nodes_of(plan: Plan, rank: int) -> set[str]:
    """The nodes whose models this rank builds: every node its worker runs a walk of."""
    return {placement.split("/")[0] for worker in plan.workers if worker.rank == rank
            for placement in worker.placements}


def build_executor(plan: Plan, rank: int, options: RankOptions, channel: Channel, device: str,
                   comms: dict[str, Any]) -> RankExecutor:
    """The rank's engine (its nodes; its shard of each TP node, `comms` from tp.build.tp_comms)."""
    from mstar.runtime.engine.torch_engine import TorchEngine, plan_glue

    gpu_switches.apply(options.blas_pdl, options.nucleus, options.penalties)  # before the graphs below
    # ranks never launch ahead (the controller's caps say so): a hybrid's states keep one copy a slot
    engine = TorchEngine(plan, dims=options.dims, weights_dir=options.weights, seed=options.seed,
                         num_pages=options.kv_pages, device=device, attention=options.attention,
                         nodes=nodes_of(plan, rank), tp_comms=comms, glue=plan_glue(plan, options.plan_path, device),
                         run_ahead=False)
    return RankExecutor(plan, engine, channel)


def serve(executor: RankExecutor, channel: Channel, rank: int) -> None:
    """Answer rank 0 until it says stop."""
    while True:
        message = channel.recv(0)
        if message.kind == "stop":
            return
        try:
            reply = _handle(executor, rank, message)
        except Exception as error:
            channel.send(0, "fatal", {"message": f"{type(error).__name__}: {error} (handling {message.kind})"},
                         timeout_s=2.0)
            raise
        if reply is not None:
            channel.send(0, *reply)


def _handle(executor: RankExecutor, rank: int, message: Message) -> Reply:
    body, kind = message.body, message.kind
    if kind == "add_request":
        request = decode_request(body["request"], message.tensors)
        return "added", {"reason": executor.add_request(body["request_id"], request)}, []
    if kind == "claim_prefix":
        return "claimed", {"num_tokens": executor.claim_prefix(body["request_id"], body["node"], body["tokens"])}, []
    if kind == "offload_figures":
        return "offload", {"figures": executor.engine.offload_figures()}, []
    if kind == "end_request":
        executor.end_request(body["request_id"])
    elif kind == "end_node":
        executor.end_node(body["request_id"], body["node"])
    elif kind == "step":
        return _step(executor, rank, message)
    elif kind == "kv_send":
        executor.kv_send(body["request_id"], body["node"], body["dst"])
    elif kind == "kv_recv":
        executor.kv_recv(body["request_id"], body["node"], body["src"])
    elif kind == "kv_drop":
        executor.kv_drop(body["request_id"], body["node"])
    else:
        raise ValueError(f"unknown command {kind!r}")
    return None


def _step(executor: RankExecutor, rank: int, message: Message) -> Reply:
    step = decode_step(message.body, message.tensors)
    try:
        result, imported = executor.run_step(step)
    except Exception as error:  # the step's requests fail alone, as in one process
        return "step_error", {"message": f"engine failed the step on rank {rank}: {error}"}, []
    if step.worker != rank:  # a TP follower: the leader answers with the rows' results
        return "done", {"imported": imported}, []
    tensors: list = []
    return "result", {"result": encode_result(result, tensors), "imported": imported}, tensors
