"""The plan: the static scheduling tables the compiler emits and the runtime executes.

A plan is data, never code. It is written as canonical JSON (sorted keys, fixed indentation)
and validated by these models on load. The runtime knows a model only through its plan; this
package imports neither the language nor the compiler.

Walk names inside a scheduling key are ordered; bit i of a mixture mask stands for
`KeyPlan.walks[i]`. Lists are kept sorted by the compiler so two compiles give identical bytes.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


class PlanModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- header


class Hashes(PlanModel):
    """sha256 (hex) of the inputs the plan was built from; the runtime re-checks them."""

    spec: str
    deployment: str
    glue: str


class Header(PlanModel):
    schema_version: int = SCHEMA_VERSION
    compiler_version: str
    model: str
    deployment: str  # config name: `orpheus_tp2` for configs/orpheus_tp2.yaml
    spec_path: str  # repository-relative, as compiled
    deployment_path: str
    glue_path: str
    hashes: Hashes


# ---------------------------------------------------------------- nodes


class RecurrentState(PlanModel):
    """Fixed-size per-request state slots for linear-attention layers (slot 0 is a padding sink)."""

    num_layers: int
    num_heads: int
    key_dim: int
    value_dim: int
    num_slots: int  # from the deployment; includes the sink slot


class NodePlan(PlanModel):
    name: str
    engine: Literal["kv", "stateless"]
    flavor: Optional[str] = None  # stateless flavour: enc_dec, audio_codec, ...
    # Model dimensions from the spec: layers, kv_heads, qo_heads, head_dim, hidden, vocab,
    # intermediate, and kind-specific ones (window, samples_per_token, layer_pattern as a list).
    dims: dict[str, Union[int, float, str, list[int]]]
    kv_sequences: list[str] = ["main"]  # KV labels per request (kv nodes)
    recurrent: Optional[RecurrentState] = None
    inputs: list[str]
    stream_inputs: list[str] = []
    is_tp: bool = False
    is_async: bool = True


# ---------------------------------------------------------------- walks


class EdgePlan(PlanModel):
    """An output edge. dest_kind says where it goes; for `node`, dest is the node's name."""

    name: str
    dest_kind: Literal["node", "conductor", "client", "stream"]
    dest: str = ""  # node name (node / stream), "" for conductor and client
    is_persist: bool = False
    is_device: bool = False  # on-device loop-back: the value never visits the host
    is_loop_back: bool = False
    is_count_tokens: bool = False
    modality: Optional[str] = None
    stream_partition: Optional[str] = None  # consumer partition for dest_kind == "stream"


class CallPlan(PlanModel):
    kind: Literal["call"] = "call"
    node: str
    inputs: list[str]
    edges: list[EdgePlan]


class ParallelPlan(PlanModel):
    kind: Literal["parallel"] = "parallel"
    body: list["SectionPlan"]


class SequentialPlan(PlanModel):
    kind: Literal["sequential"] = "sequential"
    body: list["SectionPlan"]


class LoopPlan(PlanModel):
    kind: Literal["loop"] = "loop"
    name: str  # unnamed loops get `<walk>.loop<i>`; only has_stop loops stop early
    max_iters: int  # params resolved
    has_stop: bool
    nodes: list[str]
    loop_back: list[EdgePlan]
    is_on_device: bool  # every loop-back edge stays on the device
    outputs: list[str]
    accumulate: list[str]
    body: list["SectionPlan"]


SectionPlan = Annotated[
    Union[CallPlan, ParallelPlan, SequentialPlan, LoopPlan], Field(discriminator="kind")
]


class WalkPlan(PlanModel):
    name: str
    partition: str
    nodes: list[str]  # nodes the walk runs, in first-use order
    body: list[SectionPlan]


# ---------------------------------------------------------------- partitions


class ChunkPolicyPlan(PlanModel):
    kind: Literal["window", "left_context", "fixed"]
    size: int
    stride: Optional[int] = None
    context: Optional[int] = None
    is_continue_after_done: bool = False


class StreamPlan(PlanModel):
    producer_partition: str
    edge: str
    consumer_node: str
    policy: ChunkPolicyPlan


class StagePlan(PlanModel):
    walks: list[str]  # alternatives; a request takes the first unless it asks for another
    is_optional: bool = False


class PartitionPlan(PlanModel):
    name: str
    stages: list[StagePlan]
    initial_walk: Optional[str]  # None: self-triggered from its stream buffers
    streams: list[StreamPlan] = []


# ---------------------------------------------------------------- captures and keys


class CaptureFamily(PlanModel):
    """A CUDA-graph bucket family. A live step pads up to the smallest bucket that holds it."""

    name: str  # `LLM:decode`, `LLM:mixed`
    kind: Literal["batched", "packed"]
    batch_sizes: list[int]  # sorted
    token_buckets: list[int] = []  # packed only, sorted
    tokens_per_row: int = 1  # batched only
    # Direct lookup: batch_pad[b] = smallest captured batch size >= b, or 0 when b is above
    # every bucket (the step runs eagerly). Index 0 is unused.
    batch_pad: list[int]
    num_graphs: int
    memory_bytes: int  # compile-time estimate of this family's capture memory


class MixtureEntry(PlanModel):
    """What a step holding exactly this subset of the key's walks may do."""

    mask: int  # bit i = KeyPlan.walks[i] present
    walks: list[str]
    cap: int  # most rows in such a step
    label: Optional[str] = None  # the single walk when mask has one bit: replays its own capture
    capture: Optional[str] = None  # CaptureFamily.name, None = eager
    attention: Literal["decode", "prefill", "split", "packed", "none"]


class KeyPlan(PlanModel):
    """A scheduling key: a (node, combined walk) or a (node, walk) that combines with nothing."""

    name: str  # `LLM:mixed` or `snac_decoder:snac_chunk`
    node: str
    walks: list[str]  # bit order of masks
    is_combined: bool
    mixtures: list[MixtureEntry]  # indexed by mask; entry 0 is the empty step (cap 0)
    rows_limits: dict[str, int] = {}  # walk -> most rows of that walk in a mixed step
    captures: list[CaptureFamily] = []


class SpeculationPlan(PlanModel):
    """Per (node, walk): may step N+1 be built while step N runs, and may the chain merge walks."""

    node: str
    walk: str
    can_speculate: bool  # on-device loop-back, async node, not lockstep TP
    mixes_walks: bool  # speculation_mixes_walks from the deployment


class RouteEntry(PlanModel):
    """Where one output edge of (node, walk) goes from this worker."""

    node: str
    walk: str
    edge: str
    dest_kind: Literal["node", "conductor", "client", "stream"]
    dest_node: str = ""
    dest_ranks: list[int] = []
    stream_partition: Optional[str] = None
    modality: Optional[str] = None


class TPGroup(PlanModel):
    node: str
    walks: list[str]
    ranks: list[int]
    tp_size: int
    sp_size: int
    leader: int


class WorkerPlan(PlanModel):
    rank: int
    placements: list[str]  # `node/walk` pairs this worker runs
    walk_to_key: dict[str, str]  # `node/walk` -> KeyPlan.name
    keys: list[KeyPlan]
    routes: list[RouteEntry]
    speculation: list[SpeculationPlan]
    tp_groups: list[TPGroup]  # groups this rank belongs to
    capture_memory_bytes: int


class KvPoolPlan(PlanModel):
    node: str
    page_size: int
    num_pages: int
    max_seq_len: int


class DeploymentPlan(PlanModel):
    max_seq_len: int
    max_concurrent_requests: Optional[int] = None
    capture_memory_budget_bytes: Optional[int] = None
    max_consecutive_follower_batches: int = 1
    kv_pools: list[KvPoolPlan]
    model_kwargs: dict[str, Union[int, float, str, bool]] = {}


class Plan(PlanModel):
    header: Header
    params: dict[str, int]
    nodes: list[NodePlan]
    walks: list[WalkPlan]
    partitions: list[PartitionPlan]
    deployment: DeploymentPlan
    workers: list[WorkerPlan]


ParallelPlan.model_rebuild()
SequentialPlan.model_rebuild()
LoopPlan.model_rebuild()
WalkPlan.model_rebuild()
