"""The deployment: a serving YAML read into pydantic models, every key with its source span.

In:  a path to `configs/<name>.yaml` and a `Diagnostics` collection.
Out: `Deployment` (or None when the file is unreadable, not YAML, or of the wrong shape; the
     reasons are added to the diagnostics, MW301-MW305, each at the offending key or value).

The format is the reference system's serving YAML, read unchanged: `model`, `max_seq_len`,
`node_groups` (`node_names`, `ranks`, `tp_size`, `sp_size`, `graph_walks`), `kv_cache`
overrides, `max_concurrent_requests`, `model_kwargs`, `autocast_dtype`, `resources`,
`max_prefill_chunk_size`, `scheduler_owns_chunking`, `max_step_tokens`, `dist_timeout_s`.
Beside them, mstar's own keys: `kv_pool`, `capture_memory_budget_mb`,
`speculation_mixes_walks`, `recurrent_state_slots`, `max_consecutive_follower_batches`,
`replica_policy`, `prefix_cache`.
Read for chunking, the prefix cache and offload (check_chunking, lower): `max_step_tokens`,
`max_prefill_chunk_size` with `scheduler_owns_chunking`, `kv_cache.cpu_offload_pages`, and per
node `kv_pool.nodes.NODE.{max_step_tokens, max_prefill_chunk_size, prefix_cache, cpu_offload_pages}`.
Any other key is an error at its line and column (with a "did you mean" when one is close).
"""
from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from mstar.compiler import codes
from mstar.compiler.memory_bounds import (
    MAX_CAPTURE_BUDGET_MB, MAX_CONCURRENT_REQUESTS, MAX_DIM, MAX_LAYERS, MAX_NUM_PAGES, MAX_PAGE_SIZE, MAX_RANKS,
)
from mstar.files import MAX_DEPLOYMENT_BYTES, InputFileError, read_text_bounded
from mstar.lang.ast import NO_SPAN, Span
from mstar.lang.diagnostics import Diagnostics

# The reference system's KV page defaults (KVCacheConfig), used when neither `kv_pool` nor
# `kv_cache` sets a value.
REFERENCE_PAGE_SIZE = 128
REFERENCE_NUM_PAGES = 2048

# Bounds on the YAML itself, checked on the composed node graph before any value is built: a
# 1 KB file of nested aliases ("billion laughs") expands to billions of values, and deep nesting
# exhausts the recursion of every later step. Real deployments have a few hundred values.
MAX_YAML_DEPTH = 64
MAX_YAML_VALUES = 100_000
# Integers a deployment may hold anywhere (model_kwargs included): int64.
MAX_YAML_INT = 2**63 - 1
# Rows per step of a walk with neither a cap nor a capture, and recurrent state slots, when no
# max_concurrent_requests bounds them.
UNBOUNDED_ROWS = 256
# A count or size of the device (int32), for the reference's kv_cache keys mstar does not read:
# still refused when it is no count (0, negative).
DeviceCount = Optional[Annotated[int, Field(ge=1, le=MAX_DIM)]]

class DeployModel(BaseModel):
    """A mapping of the YAML. Spans live in private attributes so no YAML key can set them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    _span: Span = PrivateAttr(default=NO_SPAN)
    _key_spans: dict[str, Span] = PrivateAttr(default_factory=dict)
    _item_spans: dict[str, list[Span]] = PrivateAttr(default_factory=dict)

    @property
    def span(self) -> Span:
        """Where the mapping starts."""
        return self._span

    def span_of(self, key: str) -> Span:
        """The span of `key` in the YAML, or of the whole mapping when the key was defaulted.

        An entry of a mapping-valued field is `field.entry` (`span_of("nodes.LLM")`).
        """
        return self._key_spans.get(key, self._span)

    def item_span(self, key: str, index: int) -> Span:
        """The span of item `index` of the list under `key`, or of the key itself."""
        items = self._item_spans.get(key, [])
        return items[index] if index < len(items) else self.span_of(key)


class NodeGroup(DeployModel):
    """Nodes placed on ranks. `graph_walks` None: every walk of those nodes."""

    node_names: list[str] = Field(min_length=1)
    ranks: list[Annotated[int, Field(ge=0, le=MAX_RANKS - 1)]] = Field(min_length=1)  # all: 0..N-1 (MW324)
    tp_size: int = Field(default=1, ge=1)
    sp_size: int = Field(default=1, ge=1)
    graph_walks: Optional[list[str]] = None

    _index: int = PrivateAttr(default=0)

    @property
    def index(self) -> int:
        """Position in the YAML list: the reference's stable group id."""
        return self._index

    @property
    def world_size(self) -> int:
        """Ranks of one lockstep instance (tp x sp)."""
        return self.tp_size * self.sp_size

    def runs(self, node: str, walk: str) -> bool:
        return node in self.node_names and (self.graph_walks is None or walk in self.graph_walks)


class KvCacheOverrides(DeployModel):
    """`kv_cache:` of the reference: overrides applied to every KV cache config."""

    num_layers: Optional[int] = Field(default=None, ge=1, le=MAX_LAYERS)  # not read (the spec's dims)
    num_kv_heads: DeviceCount = None  # not read
    num_qo_heads: DeviceCount = None  # not read
    head_dim: DeviceCount = None  # not read
    max_seq_len: Optional[int] = Field(default=None, ge=1)  # the pool must hold one (MW322)
    max_num_pages: Optional[int] = Field(default=None, ge=1, le=MAX_NUM_PAGES)
    page_size: Optional[int] = Field(default=None, ge=1, le=MAX_PAGE_SIZE)
    cpu_offload_pages: Optional[int] = Field(default=None, ge=0, le=MAX_NUM_PAGES)  # as kv_pool.nodes'
    nodes: Optional[list[str]] = None
    attention_backend: Optional[str] = None
    flashinfer_backend: Optional[str] = None


class KvPoolNode(DeployModel):
    """Per-node override inside `kv_pool.nodes` (chunking set here is always the scheduler's)."""

    page_size: Optional[int] = Field(default=None, ge=1, le=MAX_PAGE_SIZE)
    num_pages: Optional[int] = Field(default=None, ge=1, le=MAX_NUM_PAGES)
    max_step_tokens: Optional[int] = Field(default=None, ge=1)
    max_prefill_chunk_size: Optional[int] = Field(default=None, ge=1)
    prefix_cache: Optional[bool] = None
    cpu_offload_pages: Optional[int] = Field(default=None, ge=0, le=MAX_NUM_PAGES)


class KvPool(DeployModel):
    """`kv_pool:` (mstar): the paged KV pool of every kv node, with per-node overrides."""

    page_size: Optional[int] = Field(default=None, ge=1, le=MAX_PAGE_SIZE)
    num_pages: Optional[int] = Field(default=None, ge=1, le=MAX_NUM_PAGES)
    nodes: dict[str, KvPoolNode] = {}


class KvPoolSize(BaseModel):
    """The resolved pool of one node: what the plan's KvPoolPlan carries."""

    model_config = ConfigDict(frozen=True)

    page_size: int
    num_pages: int


class NodeChunking(BaseModel):
    """The resolved step token budget and chunking of one kv node, with where each was set."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    token_budget: Optional[int]  # None: no limit
    chunk_size: Optional[int]  # None: the scheduler does not cut rows
    budget_span: Span
    chunk_span: Span


class Deployment(DeployModel):
    # ---- the reference system's keys
    model: str
    max_seq_len: int = Field(ge=1)
    node_groups: list[NodeGroup] = Field(min_length=1)
    kv_cache: KvCacheOverrides = KvCacheOverrides()
    max_concurrent_requests: Optional[int] = Field(default=None, ge=1, le=MAX_CONCURRENT_REQUESTS)
    model_kwargs: dict[str, Any] = {}
    autocast_dtype: Optional[str] = None
    resources: dict[str, dict[str, Any]] = {}
    max_prefill_chunk_size: Optional[int] = Field(default=None, ge=1)
    scheduler_owns_chunking: bool = False
    max_step_tokens: Optional[int] = Field(default=None, ge=1)
    dist_timeout_s: Optional[float] = Field(default=None, gt=0)
    # ---- mstar's own keys
    kv_pool: KvPool = KvPool()
    # the plan holds it in bytes, an int64: bounded (2 TiB) so the bytes always fit
    capture_memory_budget_mb: Optional[float] = Field(default=None, gt=0, le=MAX_CAPTURE_BUDGET_MB,
                                                      allow_inf_nan=False)
    speculation_mixes_walks: list[str] = []  # "NODE" (every walk) or "NODE.WALK"
    recurrent_state_slots: Optional[int] = Field(default=None, ge=1, le=MAX_CONCURRENT_REQUESTS)
    max_consecutive_follower_batches: int = Field(default=1, ge=1)
    # How a request picks one of several data-parallel replicas of a (node, walk).
    replica_policy: Literal["request_hash", "round_robin"] = "request_hash"
    # Share full KV pages between requests by a hash of their tokens (every kv node; per node:
    # kv_pool.nodes.NODE.prefix_cache).
    prefix_cache: bool = False
    # A prompt chunk's tokens count against max_step_tokens weighted by the context they attend
    # over (KeyPlan.chunk_context_scale); false: one each, as the reference counts them.
    budget_counts_context: bool = True

    _name: str = PrivateAttr(default="")
    _path: str = PrivateAttr(default="")

    @property
    def name(self) -> str:
        """The config name: the file stem (`orpheus_tp2` for configs/orpheus_tp2.yaml)."""
        return self._name

    @property
    def path(self) -> str:
        return self._path

    def groups_for(self, node: str, walk: str) -> list[NodeGroup]:
        """Node groups that run `node` for `walk` (normally one)."""
        return [g for g in self.node_groups if g.runs(node, walk)]

    def row_limit(self) -> int:
        """Rows per step when neither a cap nor a capture bounds a walk."""
        return self.max_concurrent_requests or UNBOUNDED_ROWS

    def recurrent_slots(self) -> int:
        """Recurrent state slots of a node with recurrent state, one per request held at once (the
        plan adds the padding sink): recurrent_state_slots, else one per admitted request."""
        return self.recurrent_state_slots or self.row_limit()

    def pool_max_seq_len(self) -> int:
        """The longest request a KV pool holds: kv_cache.max_seq_len, else max_seq_len."""
        return self.kv_cache.max_seq_len or self.max_seq_len

    def ranks(self) -> list[int]:
        """Every rank any group uses, sorted: the workers."""
        return sorted({r for g in self.node_groups for r in g.ranks})

    def placements(self, pairs: Iterable[tuple[str, str]]) -> dict[int, list[tuple[str, str, NodeGroup]]]:
        """rank -> the (node, walk, group) triples of `pairs` that rank runs, in `pairs` order."""
        out: dict[int, list[tuple[str, str, NodeGroup]]] = {r: [] for r in self.ranks()}
        for node, walk in pairs:
            for group in self.groups_for(node, walk):
                for rank in dict.fromkeys(group.ranks):
                    out[rank].append((node, walk, group))
        return out

    def kv_pool_for(self, node: str) -> KvPoolSize:
        """The KV pool of a kv node: kv_pool.nodes[node], else kv_pool, else kv_cache, else the
        reference defaults (page 128, 2048 pages)."""
        per_node = self.kv_pool.nodes.get(node, KvPoolNode())
        page_size = _first(per_node.page_size, self.kv_pool.page_size, self.kv_cache.page_size,
                           REFERENCE_PAGE_SIZE)
        num_pages = _first(per_node.num_pages, self.kv_pool.num_pages, self.kv_cache.max_num_pages,
                           REFERENCE_NUM_PAGES)
        return KvPoolSize(page_size=page_size, num_pages=num_pages)

    def chunking_for(self, node: str) -> NodeChunking:
        """Step token budget and chunk size of a kv node: kv_pool.nodes[node], else the
        reference's max_step_tokens and max_prefill_chunk_size. The reference's chunk size is
        the scheduler's only with scheduler_owns_chunking (else it is not read: check_chunking
        warns). A budget the scheduler owns without a chunk size cuts rows to fit the budget."""
        per_node = self.kv_pool.nodes.get(node, KvPoolNode())
        at = f"nodes.{node}"
        budget: Optional[int]
        chunk: Optional[int]
        if per_node.max_step_tokens is not None:
            budget, budget_span = per_node.max_step_tokens, self.kv_pool.span_of(at)
        else:
            budget, budget_span = self.max_step_tokens, self.span_of("max_step_tokens")
        is_owned = self.scheduler_owns_chunking or per_node.max_prefill_chunk_size is not None
        if per_node.max_prefill_chunk_size is not None:
            chunk, chunk_span = per_node.max_prefill_chunk_size, self.kv_pool.span_of(at)
        elif self.scheduler_owns_chunking and self.max_prefill_chunk_size is not None:
            chunk, chunk_span = self.max_prefill_chunk_size, self.span_of("max_prefill_chunk_size")
        else:
            chunk, chunk_span = (budget if is_owned else None), budget_span
        return NodeChunking(token_budget=budget, chunk_size=chunk, budget_span=budget_span, chunk_span=chunk_span)

    def prefix_cache_for(self, node: str) -> bool:
        per_node = self.kv_pool.nodes.get(node, KvPoolNode()).prefix_cache
        return self.prefix_cache if per_node is None else per_node

    def host_pages_for(self, node: str) -> int:
        """The host pool of a kv node for offload: kv_pool.nodes[node].cpu_offload_pages, else the
        reference's kv_cache.cpu_offload_pages, else 0 (none)."""
        return _first(self.kv_pool.nodes.get(node, KvPoolNode()).cpu_offload_pages,
                      self.kv_cache.cpu_offload_pages, 0)

    def host_pages_span(self, node: str) -> Span:
        """Where `host_pages_for(node)` came from: the node's own key, else kv_cache's."""
        per_node = self.kv_pool.nodes.get(node)
        if per_node is not None and per_node.cpu_offload_pages is not None:
            return per_node.span_of("cpu_offload_pages")
        return self.kv_cache.span_of("cpu_offload_pages")

    def mixes_walks(self, node: str, walk: str) -> bool:
        """speculation_mixes_walks lists the node, or `node.walk`."""
        return node in self.speculation_mixes_walks or f"{node}.{walk}" in self.speculation_mixes_walks

    @property
    def capture_memory_budget_bytes(self) -> Optional[int]:
        if self.capture_memory_budget_mb is None:
            return None
        return int(self.capture_memory_budget_mb * 1024 * 1024)


def _first(*values: Optional[int]) -> int:
    return next(v for v in values if v is not None)


# ---------------------------------------------------------------- loading


def load_deployment(path: str, diags: Diagnostics) -> Optional[Deployment]:
    """Read and validate a deployment YAML. Errors go to `diags`; None when any was found."""
    file = str(path)
    try:
        text = read_text_bounded(path, max_bytes=MAX_DEPLOYMENT_BYTES, what="deployment")
    except InputFileError as err:
        diags.error(codes.DEPLOYMENT_UNREADABLE, f"cannot read deployment file {err.path}: {err.reason}",
                    Span(file=repr(file) if "\0" in file else file))
        return None
    deployment = parse_deployment(text, file, diags)
    if deployment is not None:
        deployment._name = Path(path).stem
        deployment._path = file
    return deployment


def parse_deployment(text: str, file: str, diags: Diagnostics) -> Optional[Deployment]:
    """Validate deployment YAML text; `file` names it in spans. Name and path are left empty."""
    diags.add_source(file, text)
    try:
        root = yaml.compose(text, Loader=_BoundedLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        span = _mark_span(file, mark, mark) if mark is not None else Span(file=file)
        problem = getattr(err, "problem", None) or str(err)
        diags.error(codes.DEPLOYMENT_SYNTAX, f"not valid YAML: {problem}{_yaml_hint(err)}", span)
        return None
    if root is None:
        diags.error(codes.DEPLOYMENT_MISSING_KEY, "the deployment file is empty", Span(file=file))
        return None
    num_values = _expanded_size(root, {}, set())
    if num_values > MAX_YAML_VALUES:
        diags.error(codes.DEPLOYMENT_SYNTAX,
                    f"the deployment expands to {_count(num_values)} values (YAML aliases repeating "
                    f"collections?); at most {MAX_YAML_VALUES} are read",
                    _mark_span(file, root.start_mark, root.start_mark))
        return None
    reader = _Reader(file, diags)
    data = reader.value(root, ())
    if reader.has_errors:
        return None
    if not isinstance(data, dict):
        diags.error(codes.DEPLOYMENT_BAD_VALUE, "a deployment must be a mapping of keys",
                    reader.value_spans[()])
        return None
    try:
        deployment = Deployment.model_validate(data)
    except ValidationError as err:
        _report_validation(err, reader, diags)
        return None
    _attach_spans(deployment, (), reader)
    return deployment


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing values nested deeper than MAX_YAML_DEPTH: in the scanner
    for `[`/`{` (its simple-key bookkeeping is quadratic in the flow depth: 5,000 brackets took
    seconds) and in the composer for any nesting (its recursion would end in a RecursionError)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass):
        if self.flow_level >= MAX_YAML_DEPTH:
            raise yaml.scanner.ScannerError(None, None, f"values nested more than {MAX_YAML_DEPTH} levels deep",
                                            self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"values nested more than {MAX_YAML_DEPTH} levels deep",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _tag_name(tag: str) -> str:
    """A tag as the file wrote it: `!!set` for YAML's own, else as it is (cut to 40 characters)."""
    own = "tag:yaml.org,2002:"
    name = "!!" + tag[len(own):] if tag.startswith(own) else tag
    return name if len(name) <= 40 else name[:40] + "..."


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_ids: set[int]) -> int:
    """How many values `node` becomes once every alias is expanded, computed on the composed
    graph (each distinct node once), so a billion-laughs file is measured, never expanded. A
    node that contains itself counts as one (the reader reports it)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_ids or not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        return 1
    open_ids.add(key)
    children = [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else node.value
    total = 1 + sum(_expanded_size(child, sizes, open_ids) for child in children)
    open_ids.discard(key)
    sizes[key] = total
    return total


def _count(number: int) -> str:
    return f"{number:,}" if number < 10**15 else f"about 10**{len(str(number)) - 1}"


def _yaml_hint(err: yaml.YAMLError) -> str:
    """What a user most likely wrote, for the PyYAML messages of common slips: PyYAML speaks of its
    own tokens ('expected <block end>, but found '?''), which name neither indentation nor brackets."""
    problem = str(getattr(err, "problem", "") or "")
    context = str(getattr(err, "context", "") or "")
    opened = getattr(err, "context_mark", None)
    if "'\\t'" in problem:  # PyYAML writes the character as repr() does
        return "; YAML indents with spaces, never tabs"
    if problem.startswith("expected <block end>") and opened is not None:
        return (f"; the line's indentation does not continue the block begun at line {opened.line + 1}: give "
                f"each key of a mapping, and each `-` item of a list, the indentation of the one before it")
    if problem == "mapping values are not allowed here":
        return "; is this `key:` indented further than the key above it (or a value with a `:` not in quotes)?"
    if context.startswith("while parsing a flow") and opened is not None:
        closer, what = ("]", "list") if "sequence" in context else ("}", "mapping")
        return f"; is the `{closer}` of the {what} opened at line {opened.line + 1} missing?"
    return ""


def _mark_span(file: str, start: yaml.Mark, end: yaml.Mark) -> Span:
    if end.line != start.line or end.column <= start.column:
        end_line, end_col = start.line + 1, start.column + 2
    else:
        end_line, end_col = end.line + 1, end.column + 1
    return Span(file=file, line=start.line + 1, col=start.column + 1, end_line=end_line,
                end_col=end_col)


class _Reader:
    """Turns a composed YAML node tree into plain data, recording a span per path.

    A path is a tuple of keys and list indices from the root: ("node_groups", 0, "ranks").
    """

    def __init__(self, file: str, diags: Diagnostics):
        self.file = file
        self.diags = diags
        self.key_spans: dict[tuple, Span] = {}
        self.value_spans: dict[tuple, Span] = {}
        self.has_errors = False
        self._constructor = yaml.SafeLoader("")
        self._open: set[int] = set()  # ids of collection nodes being read (alias cycles)

    def span(self, node: yaml.Node) -> Span:
        return _mark_span(self.file, node.start_mark, node.end_mark)

    def value(self, node: yaml.Node, path: tuple) -> Any:
        self.value_spans[path] = self.span(node)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            if id(node) in self._open:
                self._error(codes.DEPLOYMENT_BAD_VALUE, "a value may not contain itself", node)
                return None
            self._open.add(id(node))
            try:
                return self._collection(node, path)
            finally:
                self._open.discard(id(node))
        return self._scalar(node)

    def _scalar(self, node: yaml.Node) -> Any:
        try:
            value = self._constructor.construct_object(node)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err)
            self._error(codes.DEPLOYMENT_BAD_VALUE, f"unsupported value: {problem}", node)
            return None
        except (ValueError, OverflowError) as err:  # an integer of thousands of digits, say
            self._error(codes.DEPLOYMENT_BAD_VALUE, f"unsupported value: {err}", node)
            return None
        problem = _scalar_problem(value)
        if problem is not None:
            self._error(codes.DEPLOYMENT_BAD_VALUE, problem, node)
            return None
        return value

    def _collection(self, node: yaml.Node, path: tuple) -> Any:
        plain = "tag:yaml.org,2002:map" if isinstance(node, yaml.MappingNode) else "tag:yaml.org,2002:seq"
        if node.tag != plain:  # `!!set {x}`, `!!omap [...]`, `!foo [0]`: read as plain ones before
            self._error(codes.DEPLOYMENT_BAD_VALUE, f"unsupported value: the tag '{_tag_name(node.tag)}' (a deployment "
                        "holds plain YAML lists and mappings)", node)
            return None
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = self._scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(key, str):
                    self._error(codes.DEPLOYMENT_BAD_VALUE, "a key must be a plain string", key_node)
                    continue
                if key in out:
                    self._error(codes.DEPLOYMENT_BAD_VALUE, f"key '{key}' given twice", key_node)
                    continue
                self.key_spans[path + (key,)] = self.span(key_node)
                out[key] = self.value(value_node, path + (key,))
            return out
        return [self.value(item, path + (i,)) for i, item in enumerate(node.value)]

    def _error(self, code: str, message: str, node: yaml.Node) -> None:
        self.has_errors = True
        self.diags.error(code, message, self.span(node))

    def key_span(self, path: tuple) -> Span:
        """The key's span for a mapping entry, else the value's, else the nearest parent's."""
        while path:
            if path in self.key_spans:
                return self.key_spans[path]
            if path in self.value_spans:
                return self.value_spans[path]
            path = path[:-1]
        return self.value_spans.get((), Span(file=self.file))


def _scalar_problem(value: Any) -> Optional[str]:
    """Why a scalar cannot be a deployment value (it must survive into the plan's JSON)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        if abs(value) > MAX_YAML_INT:
            return f"integer {_count(abs(value))} is out of range (at most {MAX_YAML_INT} in magnitude)"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (f"{value} is not a finite number; a deployment "
                                                   "holds finite numbers only")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return (f"string holds {value[err.start]!r}, an unpaired surrogate, which is not text "
                    "(write the character itself)")
        return None
    return (f"a {type(value).__name__} value is not a deployment value (strings, numbers, booleans, "
            "lists and mappings only)")


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(path: tuple) -> Optional[type[DeployModel]]:
    """The DeployModel class that validates the mapping at `path`, if any."""
    model: Any = Deployment
    for part in path:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, DeployModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _inner_model(field.annotation)
    return model if isinstance(model, type) and issubclass(model, DeployModel) else None


def _inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, DeployModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _suggested_keys(errors: list) -> set[tuple]:
    """The locations an unknown key's "did you mean" names: a misspelt required key is reported
    once, as that (MW303), not a second time as missing (MW305)."""
    suggested: set[tuple] = set()
    for item in errors:
        loc = tuple(item["loc"])
        owner = _model_at(loc[:-1]) if item["type"] == "extra_forbidden" else None
        if owner is not None:
            close = difflib.get_close_matches(str(loc[-1]), owner.model_fields, n=1)
            suggested.update(loc[:-1] + (key,) for key in close)
    return suggested


def _report_validation(err: ValidationError, reader: _Reader, diags: Diagnostics) -> None:
    seen: set[tuple] = set()
    errors = err.errors()
    suggested = _suggested_keys(errors)
    for item in errors:
        loc = tuple(item["loc"])
        if loc in seen or (item["type"] == "missing" and loc in suggested):
            continue
        seen.add(loc)
        kind = item["type"]
        where = _dotted(loc)
        if kind == "extra_forbidden":
            key = str(loc[-1])
            owner = _model_at(loc[:-1])
            allowed = sorted(owner.model_fields) if owner is not None else []
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            scope = f" in {_dotted(loc[:-1])}" if len(loc) > 1 else ""
            diags.error(codes.DEPLOYMENT_UNKNOWN_KEY, f"unknown key '{key}'{scope}{hint}",
                        reader.key_span(loc))
        elif kind == "missing":
            parent = loc[:-1]
            span = reader.value_spans.get(parent) or reader.key_span(parent)
            diags.error(codes.DEPLOYMENT_MISSING_KEY, f"missing required key '{where}'", span)
        else:
            span = reader.value_spans.get(loc) or reader.key_span(loc)
            got = item.get("input")
            shown = f" (got {got!r})" if isinstance(got, (str, int, float, bool)) or got is None else ""
            message = item["msg"][0].lower() + item["msg"][1:]
            diags.error(codes.DEPLOYMENT_BAD_VALUE, f"{where}: {message}{shown}", span)


def _attach_spans(model: DeployModel, path: tuple, reader: _Reader) -> None:
    model._span = reader.value_spans.get(path, Span(file=reader.file))
    for key in type(model).model_fields:
        key_path = path + (key,)
        if key_path in reader.key_spans:
            model._key_spans[key] = reader.key_spans[key_path]
        value = getattr(model, key)
        if isinstance(value, list):
            model._item_spans[key] = [
                reader.value_spans.get(key_path + (i,), model.span_of(key)) for i in range(len(value))
            ]
            for i, item in enumerate(value):
                if isinstance(item, DeployModel):
                    _attach_spans(item, key_path + (i,), reader)
                    if isinstance(item, NodeGroup):
                        item._index = i
        elif isinstance(value, dict):
            for sub_key, item in value.items():
                if key_path + (sub_key,) in reader.key_spans:
                    model._key_spans[f"{key}.{sub_key}"] = reader.key_spans[key_path + (sub_key,)]
                if isinstance(item, DeployModel):
                    _attach_spans(item, key_path + (sub_key,), reader)
        elif isinstance(value, DeployModel):
            _attach_spans(value, key_path, reader)
