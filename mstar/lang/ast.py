"""The AST of a `.mw` spec: pydantic models, one class per grammar rule.

Every node carries a `span` (where it came from in the source) and the `#` comments kept with it
(see `AstNode`). Neither spans nor comments take part in equality of meaning: compare two trees
with `same_meaning(a, b)`, which drops them, so that `parse(fmt(tree))` can be checked against
`tree`.

Class names match the grammar's rule names (grammar/mw.lark), so the Lark transformer only
converts terminals and builds these classes by name.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Span(BaseModel):
    """A source range: 1-based line and column, end exclusive."""

    model_config = ConfigDict(frozen=True)

    file: str = "<spec>"
    line: int = 1
    col: int = 1
    end_line: int = 1
    end_col: int = 1


NO_SPAN = Span()


class AstNode(BaseModel):
    """Base of every AST class.

    Comments are kept on the constructs the formatter starts on a line of their own (the model
    line, params, node statements, walks, sections, edges, partitions, stream sources; see
    mstar/lang/comments.py): `comments_before` holds the full-line comments directly above the
    construct, `comment_after` the comment that ends the construct's first line. A comment is
    its source text from `#` on, without trailing whitespace.
    """

    model_config = ConfigDict(extra="forbid")

    span: Span = Field(default=NO_SPAN, repr=False)
    comments_before: list[str] = Field(default=[], repr=False)
    comment_after: Optional[str] = Field(default=None, repr=False)


# A parameter value in a node header or a state declaration: `layers=28`, `style=llama`,
# `layer_pattern=[0,0,0,1]`.
ArgValue = Union[int, float, str, list[int]]


class Arg(AstNode):
    name: str
    value: ArgValue


class Param(AstNode):
    """`param max_output_tokens = 2048`: a named integer used by loops (`max=NAME`)."""

    name: str
    value: int


def values_by_name(items: "list[Arg] | list[Param]") -> dict:
    """Arguments or params as `{name: value}`: a declaration's dims, a state's sizes, a spec's params."""
    return {item.name: item.value for item in items}


# ---- roles: what a value is (docs/language.md "Roles"). The plan carries the same words
# (mstar/plan/schema.py); tests/lang/test_lang_roles.py checks that the two lists agree.

# What an input takes: token ids; embeddings or hidden states (added to the token embeddings);
# a mask; an image flow's latents or time index; media features (an encoder's input); a signal
# the models do not read (metadata such as grid sizes).
InputRole = Literal["tokens", "embeddings", "hidden", "mask", "flow_latents", "flow_time", "media", "signal"]
# What an output carries: sampled token ids; the last token's hidden state (`embeddings`, the next
# input embedding) or every token's (`hidden`); a mask; a flow velocity, the next latents or time
# index; audio samples; an image; the tokens of a transcript as they become final (Whisper's long-form
# segments); a signal the models do not read (a position in the request's media).
OutputRole = Literal["tokens", "embeddings", "hidden", "mask", "velocity", "flow_latents", "flow_time", "audio",
                     "image", "transcript", "signal"]
Modality = Literal["text", "image", "audio"]
# What a client edge may carry: a modality, a robot's actions (a flow's final latents: Pi0.5's
# action chunk), or latent representations (hidden states: V-JEPA 2's predicted frame features).
# A prompt or a guidance drop is one of the modalities only.
ClientModality = Literal["text", "image", "audio", "action", "latents"]
# The model of a stateless node (a kv node is always a decoder).
ModelKind = Literal["audio_codec", "image_decoder", "vision_encoder", "audio_encoder"]
INPUT_ROLES: tuple[str, ...] = InputRole.__args__  # type: ignore[attr-defined]
OUTPUT_ROLES: tuple[str, ...] = OutputRole.__args__  # type: ignore[attr-defined]
MODALITIES: tuple[str, ...] = Modality.__args__  # type: ignore[attr-defined]
CLIENT_MODALITIES: tuple[str, ...] = ClientModality.__args__  # type: ignore[attr-defined]
MODEL_KINDS: tuple[str, ...] = ModelKind.__args__  # type: ignore[attr-defined]
# What rows of one walk must agree on to share a step: the tokens they feed, their loop
# iteration, their guidance mode (the guidance sequences in use).
BatchRule = Literal["shape", "iteration", "guidance"]
BATCH_RULES: tuple[str, ...] = BatchRule.__args__  # type: ignore[attr-defined]


class InputDecl(AstNode):
    """`in text_inputs: tokens prompt text`, `in new_token stream: tokens` (fed by a stream chunk
    policy). `role` None: the author wrote none (the compiler reports it); `prompt`: the modality of
    the request's prompt this input receives."""

    name: str
    is_stream: bool = False
    role: Optional[InputRole] = None
    prompt: Optional[Modality] = None


class OutputDecl(AstNode):
    """`out new_token: tokens`: a value the node produces; edges of its calls carry outputs by name."""

    name: str
    role: OutputRole


class CrossKv(AstNode):
    """`cross_kv audio from encoder_states tokens=1500`: a cross-attention KV pool (label `audio`)
    each request owns on this kv node, filled once from the input `source` (another model's states,
    at most `num_tokens` of them) by the walks whose `kv` line writes it, and attended over by the
    walks whose `kv` line reads it (Whisper's decoder over its encoder's states)."""

    label: str
    source: str
    num_tokens: int


class GuidanceDecl(AstNode):
    """`guidance cfg_text drops text scale=4.0`: a KV sequence kept without the prompt's `drops`
    part, for classifier-free guidance, and its default scale (a request may set its own)."""

    label: str
    drops: Modality
    scale: float


class KvAccess(AstNode):
    """`kv image_gen reads main cfg_text cfg_img` / `kv prefill_text writes main cfg_img`: the KV
    sequences a walk's rows on this node attend over without extending (`reads`) and extend
    (`writes`, which they attend over too)."""

    walk: str
    reads: list[str] = []
    writes: list[str] = []


class KvSequences(AstNode):
    """`kv_sequences main cfg_text cfg_img`: KV sequences (labels) each request owns on this node."""

    labels: list[str]


class Bidirectional(AstNode):
    """`bidirectional prefill_vit prefill_vae`: walks whose rows on this node attend to all of
    their own tokens (and the cached context), not causally. Other walks attend causally."""

    walks: list[str]


class StateDecl(AstNode):
    """A per-request state resource besides the paged KV cache.

    `state recurrent(layers=18, heads=16, key_dim=128, value_dim=128)`: fixed-size recurrent
    state slots for linear-attention layers (one slot per live request).
    """

    kind: Literal["recurrent"]
    args: list[Arg] = []


class SubModelDecl(AstNode):
    """`submodel action_expert(hidden=1024, intermediate=4096) for action_gen`: rows of those walks
    on this kv node run a second model: the node's dims with these overridden (only widths that
    keep the KV geometry: layers, KV heads and head size stay the node's, so the sub-model attends
    over the same KV cache, as Pi0.5's action expert reads the prefix the main model wrote).

    With `samples OUTPUT depth=N` it is a depth model instead: the walks' rows run the node's model,
    then this one, which takes the node's last hidden state and the token the node sampled for the
    `tokens` output OUTPUT and, in a short inner loop over its own small KV, samples N further tokens
    of that output, one per inner position with its own vocabulary (`vocab`) and head (Qwen3-TTS's
    code predictor: codebook 0 from the Talker, codebooks 1..15 from the predictor). Its geometry
    (layers, KV heads, head size) is its own."""

    name: str
    args: list[Arg] = []
    samples: Optional[str] = None  # a depth model: the tokens output it extends
    depth: int = 0  # a depth model: further tokens per step (the inner loop's count)
    walks: list[str]


class CapDecl(AstNode):
    """`cap decode 64`: the most rows a step of one walk may hold."""

    walk: str
    value: int


class BatchingDecl(AstNode):
    """`batching image_gen same shape, iteration, guidance`: rows of that walk on this node share a
    step only with rows that agree on every rule (the cap still bounds the step)."""

    walk: str
    rules: list[BatchRule]


class CaptureDecl(AstNode):
    """A CUDA-graph bucket family.

    batched: fixed tokens per row, key = batch size. packed: key = batch size x token bucket.
    `walk` is None inside a `combine` block (the capture belongs to the combined walk).
    """

    walk: Optional[str] = None
    family: Literal["batched", "packed"]
    batch: list[int]
    tokens: list[int] = []
    tokens_per_row: int = 1
    # `guided` / `unguided`: only steps of that guidance mode replay the family (a step is guided
    # when some row's request requires guidance on the node); None: steps of either mode do
    guidance: Optional[Literal["guided", "unguided"]] = None
    # `labels=[main, cfg_img]`: the KV sequences the family's graphs touch, as written (empty: not
    # written; the compiler then takes the sequences the walk's steps of that mode touch)
    labels: list[str] = []
    # `eager_above`: steps of more rows than the largest batch size run eagerly by intent, so a
    # cap above it is allowed (MW405 is not reported)
    is_eager_above: bool = False
    # `piecewise`: the family's graphs hold everything but attention, which runs eagerly between the
    # captured pieces (so a packed family's variable attention plan needs no buffers at fixed addresses)
    is_piecewise: bool = False
    # `unroll_prompts=N` (batched, one token a row): a step whose prompt rows hold at most N tokens
    # each replays the family as one row per query token, each row with its own KV length; 0: never
    unroll_prompts: int = 0


class CaptureReplay(AstNode):
    """`capture decode_cfg replays decode`: one-walk steps of `walk` on this node replay the capture
    families of `source` (its own `capture` lines), beside any of its own; the reference's
    replay_graph_walks."""

    walk: str
    source: str


class RowsLimit(AstNode):
    """`rows prefill <= 4`: at most n rows of that walk inside a mixed step."""

    walk: str
    limit: int


class CombineDecl(AstNode):
    """`combine mixed = prefill + decode { ... }`: walks the scheduler may put in one step."""

    name: str
    walks: list[str]
    cap: Optional[int] = None
    rows: list[RowsLimit] = []
    capture: Optional[CaptureDecl] = None
    attention: Optional[Literal["split", "packed"]] = None
    # `cap` and `attention` are plain settings rather than AST nodes, so their lines' comments
    # live here (same meaning as AstNode's comment fields).
    cap_comments_before: list[str] = Field(default=[], repr=False)
    cap_comment_after: Optional[str] = Field(default=None, repr=False)
    attention_comments_before: list[str] = Field(default=[], repr=False)
    attention_comment_after: Optional[str] = Field(default=None, repr=False)
    comments_end: list[str] = Field(default=[], repr=False)  # full-line comments before `}`
    cap_span: Optional[Span] = Field(default=None, repr=False)  # where `cap N` is written


class PromptFormat(AstNode):
    """`prompt_format "{voice}: {prompt}" before=[128259] after=[128009] voice="tara"`: how a text
    prompt becomes tokens. The template's `{prompt}` is the request's text; its other fields come
    from the request (a prompts line's or an HTTP request's field of that name), else from the
    defaults given here. `before` and `after` are token ids put around the tokenized text."""

    template: str
    args: list[Arg] = []


class NodeDecl(AstNode):
    name: str
    engine: Literal["kv", "stateless"]
    model_kind: Optional[ModelKind] = None  # `stateless audio_codec`: stateless nodes only
    args: list[Arg] = []
    is_tp: bool = False  # `tp`: the node may be tensor-parallel
    is_async: bool = True  # `no_speculation`: the node opts out of async scheduling
    kv_sequences: Optional[KvSequences] = None
    cross_kv: list[CrossKv] = []
    guidance: list[GuidanceDecl] = []
    kv_access: list[KvAccess] = []
    bidirectional: Optional[Bidirectional] = None
    states: list[StateDecl] = []
    submodels: list[SubModelDecl] = []
    inputs: list[InputDecl] = []
    outputs: list[OutputDecl] = []
    caps: list[CapDecl] = []
    batching: list[BatchingDecl] = []
    captures: list[CaptureDecl] = []
    capture_replays: list[CaptureReplay] = []
    combines: list[CombineDecl] = []
    prompt_format: Optional[PromptFormat] = None
    comments_end: list[str] = Field(default=[], repr=False)  # full-line comments before `}`


class Edge(AstNode):
    """`-> name: dest flags...`.

    dest is a node name, `conductor` (handed back to the conductor) or `client`.
    Flags: persist (kept by the conductor across walks), stream (to another partition through
    its chunk policy), device (loop-back that stays on the device), count_tokens (counts toward
    the request's output tokens); `modality` names what a client edge carries (text, audio, image).
    `name` is an output of the calling node and, for a node destination, an input of that node.
    """

    name: str
    dest: str
    is_persist: bool = False
    is_stream: bool = False
    is_device: bool = False
    is_count_tokens: bool = False
    modality: Optional[ClientModality] = None


class Call(AstNode):
    """`LLM(text_inputs) -> ...`: one node run on its inputs, with its output edges."""

    kind: Literal["call"] = "call"
    node: str
    inputs: list[str]
    edges: list[Edge] = []


class Parallel(AstNode):
    kind: Literal["parallel"] = "parallel"
    body: list["Section"]
    comments_end: list[str] = Field(default=[], repr=False)  # full-line comments before `}`


class Sequential(AstNode):
    kind: Literal["sequential"] = "sequential"
    body: list["Section"]
    comments_end: list[str] = Field(default=[], repr=False)  # full-line comments before `}`


class Loop(AstNode):
    """`loop NAME max=N|PARAM [count=PARAM] [stop] { ... } [outputs a, b] [accumulate c]`."""

    kind: Literal["loop"] = "loop"
    name: Optional[str] = None  # only a named loop accepts an early stop
    max_iters: Union[int, str]
    # `count=PARAM`: a request runs this many iterations (the param's value unless the request sets
    # its own under the param's name), at most max_iters; None: always max_iters (or a stop)
    count: Optional[str] = None
    has_stop: bool = False
    body: list["Section"]
    outputs: list[str] = []
    accumulate: list[str] = []
    comments_end: list[str] = Field(default=[], repr=False)  # full-line comments before `}`


Section = Annotated[Union[Call, Parallel, Sequential, Loop], Field(discriminator="kind")]


class Walk(AstNode):
    name: str
    body: list[Section]
    comments_end: list[str] = Field(default=[], repr=False)  # full-line comments before `}`


class ChunkPolicy(AstNode):
    """How a stream is cut into chunks for its consumer partition.

    window(size, stride=s): sliding window; left_context(chunk=c, context=k): chunks with k items
    of overlap; fixed(size[, continue_after_done]): fixed-size chunks.
    """

    kind: Literal["window", "left_context", "fixed"]
    size: int
    stride: Optional[int] = None
    context: Optional[int] = None
    is_continue_after_done: bool = False


class StreamSource(AstNode):
    """`<- LLM.new_token window(28, stride=7)`: a producer partition's edge feeding this one."""

    partition: str
    edge: str
    policy: ChunkPolicy
    # `keep 128266..156937`: items outside [low, high] leave the stream before it is cut, so
    # they take no position in a window (Orpheus's non-audio tokens)
    keep: Optional[tuple[int, int]] = None


class Stage(AstNode):
    """One step of a partition's walk order: alternatives (`decode | image_gen`), optional (`?`).

    An alternative may be a sequence of walks (`(prefill_audio -> prefill_text | prefill_vision)?`):
    then `sequence_lengths` says how many walks each alternative has, in order, and `walks` holds
    every alternative's walks one after another; empty when each alternative is one walk (so
    `walks` are the alternatives). `alternatives(stage)` gives them as lists.
    """

    walks: list[str]
    is_optional: bool = False
    sequence_lengths: list[int] = []


def alternatives(stage: Stage) -> list[list[str]]:
    """The stage's alternatives, each a sequence of walks (one walk unless written with `->`)."""
    if not stage.sequence_lengths:
        return [[walk] for walk in stage.walks]
    found, at = [], 0
    for length in stage.sequence_lengths:
        found.append(stage.walks[at:at + length])
        at += length
    return found


class Repeat(AstNode):
    """`repeat while audio_left max=max_windows`: after the last stage the partition runs its
    stages again, from the first, while its persisted value `value` is above zero, at most
    `max_rounds` rounds in all (a number or a param name). Whisper's long-form windows."""

    value: str
    max_rounds: Union[int, str]


class Partition(AstNode):
    """`partition LLM = prefill -> decode` or `partition SNAC = snac_chunk <- LLM.new_token ...`.

    Requests move through the stages in order. A partition fed by streams with no explicit
    initial walk self-triggers from its stream buffer.
    """

    name: str
    stages: list[Stage]
    repeat: Optional[Repeat] = None
    streams: list[StreamSource] = []


class Spec(AstNode):
    """A whole spec. Its `comments_before` / `comment_after` belong to the `model` line."""

    model: str
    params: list[Param] = []
    nodes: list[NodeDecl] = []
    walks: list[Walk] = []
    partitions: list[Partition] = []
    comments_end: list[str] = Field(default=[], repr=False)  # full-line comments at the end of file


Parallel.model_rebuild()
Sequential.model_rebuild()
Loop.model_rebuild()
Walk.model_rebuild()


# Fields that say where a construct came from or what the author wrote beside it, not what it means.
NOT_MEANING = frozenset({
    "span", "comments_before", "comment_after", "comments_end", "cap_comments_before",
    "cap_comment_after", "attention_comments_before", "attention_comment_after", "cap_span",
})


def _drop_not_meaning(value):
    if isinstance(value, dict):
        return {k: _drop_not_meaning(v) for k, v in value.items() if k not in NOT_MEANING}
    if isinstance(value, list):
        return [_drop_not_meaning(v) for v in value]
    return value


def meaning(tree: AstNode) -> dict:
    """The tree as plain data without spans and comments: what `same_meaning` compares."""
    return _drop_not_meaning(tree.model_dump())


def same_meaning(a: AstNode, b: AstNode) -> bool:
    return meaning(a) == meaning(b)
