"""Small hand-built plans for the glue tests (an Orpheus-like LLM + codec on one or two workers)."""
from __future__ import annotations

from plan_roles import node_plan
from mstar.compiler.lower_tables import tables_for
from mstar.compiler.walk_tree import TreeCall as CallPlan, TreeEdge as EdgePlan, TreeLoop as LoopPlan
from mstar.compiler.walk_tree import WalkTree as WalkPlan
from mstar.plan.schema import (
    CaptureFamily,
    DeploymentPlan,
    Hashes,
    Header,
    KeyPlan,
    KvPoolPlan,
    MixtureEntry,
    PartitionPlan,
    Plan,
    StagePlan,
    WorkerPlan,
)


def _header(glue_hash: str = "0" * 64) -> Header:
    return Header(compiler_version="test", model="tiny", deployment="tiny", spec_path="specs/tiny.mw",
                  deployment_path="configs/tiny.yaml", glue_path="generated/tiny_glue.py",
                  hashes=Hashes(spec="1" * 64, deployment="2" * 64, glue=glue_hash))


def _family(name: str, kind: str, batch_sizes: list[int], token_buckets: list[int] = ()) -> CaptureFamily:
    pad = [0] * (max(batch_sizes) + 1)
    for b in range(1, len(pad)):
        pad[b] = min(s for s in batch_sizes if s >= b)
    return CaptureFamily(name=name, kind=kind, batch_sizes=batch_sizes, token_buckets=list(token_buckets),
                         batch_pad=pad, num_graphs=len(batch_sizes) * max(len(token_buckets), 1),
                         memory_bytes=0)


def _walks() -> list[WalkPlan]:
    stream = EdgePlan(name="new_token", dest_kind="stream", dest="codec", stream_partition="CODEC")
    prefill = WalkPlan(name="prefill", partition="LLM", nodes=["LLM"], body=[CallPlan(
        node="LLM", inputs=["text_inputs"],
        edges=[EdgePlan(name="new_token", dest_kind="conductor", is_persist=True, is_count_tokens=True), stream])])
    loop_back = EdgePlan(name="text_inputs", dest_kind="node", dest="LLM", is_device=True, is_loop_back=True)
    decode = WalkPlan(name="decode", partition="LLM", nodes=["LLM"], body=[LoopPlan(
        name="decode_loop", max_iters=16, has_stop=True, nodes=["LLM"], loop_back=[loop_back],
        is_on_device=True, outputs=[], accumulate=[],
        body=[CallPlan(node="LLM", inputs=["text_inputs"], edges=[loop_back, stream])])])
    chunk = WalkPlan(name="codec_chunk", partition="CODEC", nodes=["codec"], body=[CallPlan(
        node="codec", inputs=["new_token"],
        edges=[EdgePlan(name="audio", dest_kind="client", modality="audio")])])
    return [chunk, decode, prefill]


def _llm_key(decode_batches: list[int]) -> KeyPlan:
    mixtures = [
        MixtureEntry(mask=0, walks=[], cap=0, attention="none"),
        MixtureEntry(mask=1, walks=["prefill"], cap=4, label="prefill", capture="LLM:prefill", attention="prefill"),
        MixtureEntry(mask=2, walks=["decode"], cap=8, label="decode", capture="LLM:decode", attention="decode"),
        MixtureEntry(mask=3, walks=["prefill", "decode"], cap=8, capture="LLM:mixed", attention="packed"),
    ]
    captures = [
        _family("LLM:decode", "batched", decode_batches),
        _family("LLM:mixed", "packed", [2, 8], [16, 64]),
        _family("LLM:prefill", "packed", [1, 4], [16, 32]),
    ]
    return KeyPlan(name="LLM:mixed", node="LLM", walks=["prefill", "decode"], is_combined=True,
                   mixtures=mixtures, rows_limits={"prefill": 2}, captures=captures)


def _codec_key() -> KeyPlan:
    return KeyPlan(name="codec:codec_chunk", node="codec", walks=["codec_chunk"], is_combined=False,
                   mixtures=[MixtureEntry(mask=0, walks=[], cap=0, attention="none"),
                             MixtureEntry(mask=1, walks=["codec_chunk"], cap=4, label="codec_chunk",
                                          attention="none")])


def _worker(rank: int, decode_batches: list[int]) -> WorkerPlan:
    return WorkerPlan(rank=rank, placements=["LLM/decode", "LLM/prefill", "codec/codec_chunk"],
                      walk_to_key={"LLM/prefill": "LLM:mixed", "LLM/decode": "LLM:mixed",
                                   "codec/codec_chunk": "codec:codec_chunk"},
                      keys=[_codec_key(), _llm_key(decode_batches)], speculation=[], tp_groups=[],
                      capture_memory_bytes=0)


def tiny_plan(page_size: int = 4, glue_hash: str = "0" * 64, num_workers: int = 1,
              differing_worker: bool = False) -> Plan:
    """An LLM (prefill + decode combined, decode looping on the device) and a codec.

    With differing_worker, worker 1 captures other decode batch sizes, so `LLM:mixed` has two
    constant variants.
    """
    workers = [_worker(rank, [1, 2, 4, 8] if rank == 0 or not differing_worker else [1, 16])
               for rank in range(num_workers)]
    nodes = [node_plan("LLM", "kv", _walks(), dims={"layers": 2, "vocab": 100}, inputs=["text_inputs"]),
             node_plan("codec", "stateless", _walks(), dims={}, inputs=["new_token"], stream_inputs=["new_token"],
                       output_roles={"audio_chunk": "audio"})]
    partitions = [PartitionPlan(name="LLM", stages=[StagePlan(walks=["prefill"]), StagePlan(walks=["decode"])],
                                initial_walk="prefill"),
                  PartitionPlan(name="CODEC", stages=[StagePlan(walks=["codec_chunk"])], initial_walk=None)]
    return Plan(
        header=_header(glue_hash),
        params={"max_output_tokens": 16},
        nodes=nodes,
        walks=tables_for(_walks(), partitions, nodes, workers),
        partitions=partitions,
        deployment=DeploymentPlan(max_seq_len=64, kv_pools=[KvPoolPlan(node="LLM", page_size=page_size,
                                                                       num_pages=64, max_seq_len=64)]),
        workers=workers,
    )
