"""Emit pass, glue half: render a plan's Triton glue module from the Jinja2 templates.

In:  a `Plan` (its header is never read: the header carries the glue's own hash), the model
     name and the deployment (config) name, for the generated file's header comment.
Out: the Python source of `generated/<config>_glue.py`: per scheduling key of a kv node, a
     `pack_step` kernel and a `scatter_after_sampling` kernel specialised on the plan's
     constants (page size, the key's walk order, which walks loop back on the device, stream
     or need the host, the largest step, captured batch sizes), their host launchers, and the
     `KEYS` / `WORKER_KEYS` tables the runtime looks them up in. docs/glue.md describes them;
     `mstar.runtime.engine.glue_reference` holds the torch functions they must equal.

Same plan and names in, same bytes out: every table is walked in sorted order.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from mstar.plan.schema import KeyPlan, Plan, WalkPlan

TEMPLATE_DIR = Path(__file__).parent / "templates"
MODULE_TEMPLATE = "glue.py.j2"
# Tokens / pages one kernel program copies per loop turn (powers of two, as tl.arange needs).
BLOCK_TOKENS = 64
BLOCK_PAGES = 64


class GlueError(ValueError):
    """The plan is inconsistent in a way the glue cannot be specialised on (a compiler bug)."""


@dataclass(frozen=True)
class WalkFlags:
    """Where a walk's sampled token goes, from the edges of its calls of the key's node."""

    is_device_loop: bool  # an edge stays on the device: the token loops back without the host
    is_stream: bool  # an edge streams to another partition
    is_host: bool  # an edge leaves the device, or the call sits in a loop with a stop check


@dataclass(frozen=True)
class KeyGlueSpec:
    """Everything one key's kernels are specialised on."""

    ident: str  # Python identifier suffix of the key's kernels and launchers
    key: str
    node: str
    walks: tuple[str, ...]
    page_size: int
    max_rows: int
    block_rows: int  # power of two >= max_rows: the block the kernels' prefix sums run over
    device_walks: tuple[int, ...]  # indices into walks
    stream_walks: tuple[int, ...]
    host_walks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    token_buckets: tuple[int, ...]
    ranks: tuple[int, ...]  # workers whose plan holds this key with these constants

    def names(self, indices: tuple[int, ...]) -> str:
        """The walk names at `indices`, comma-separated (for the generated comments)."""
        return ", ".join(self.walks[i] for i in indices)

    @property
    def device_loop_mask(self) -> int:
        return _mask(self.device_walks)

    @property
    def stream_mask(self) -> int:
        return _mask(self.stream_walks)

    @property
    def host_mask(self) -> int:
        return _mask(self.host_walks)


def render_glue(plan: Plan, model: str, deployment: str) -> str:
    """The glue module's source for `plan`; `model` and `deployment` only name the inputs in the
    header comment (pass the spec's model name and the config name, e.g. `orpheus_tp2`)."""
    for label, name in (("model", model), ("deployment", deployment)):
        # They land in comments and a docstring: one printable line keeps the module valid.
        if not name.isprintable() or '"""' in name:
            raise GlueError(f"{label} name {name!r} cannot go into the glue file's header")
    specs = glue_specs(plan)
    worker_keys = {
        rank: sorted((spec.key, spec.ident) for spec in specs if rank in spec.ranks)
        for rank in sorted({rank for spec in specs for rank in spec.ranks})
    }
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["walk_test"] = _walk_test
    env.filters["pyrepr"] = repr
    template = env.get_template(MODULE_TEMPLATE)
    return template.render(model=model, deployment=deployment, keys=specs, worker_keys=worker_keys,
                           block_tokens=BLOCK_TOKENS, block_pages=BLOCK_PAGES)


def glue_specs(plan: Plan) -> list[KeyGlueSpec]:
    """One spec per distinct (key, constants) over all workers, sorted by key name then rank.

    Keys of stateless nodes get no glue: their inputs are dense tensors, not paged token rows.
    A key that two workers hold with different constants gets one spec per variant.
    """
    page_sizes = {pool.node: pool.page_size for pool in plan.deployment.kv_pools}
    kv_nodes = {node.name for node in plan.nodes if node.engine == "kv"}
    walks = {walk.name: walk for walk in plan.walks}
    variants: dict[_KeyConstants, list[int]] = {}
    for worker in sorted(plan.workers, key=lambda w: w.rank):
        for key in sorted(worker.keys, key=lambda k: k.name):
            if key.node not in kv_nodes:
                continue
            if key.node not in page_sizes:
                raise GlueError(f"kv node `{key.node}` of key `{key.name}` has no kv pool in the plan")
            variants.setdefault(_key_constants(key, page_sizes[key.node], walks), []).append(worker.rank)
    specs = []
    used_idents: set[str] = set()
    for constants in sorted(variants, key=lambda c: (c[0], variants[c][0])):
        ident = _unique_ident(constants[0], used_idents)
        specs.append(KeyGlueSpec(ident, *constants, ranks=tuple(variants[constants])))
    return specs


# The fields of KeyGlueSpec after `ident`, before `ranks`.
_KeyConstants = tuple[str, str, tuple[str, ...], int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                      tuple[int, ...], tuple[int, ...]]


def _key_constants(key: KeyPlan, page_size: int, walks: dict) -> _KeyConstants:
    """The fields of KeyGlueSpec after `ident`, before `ranks`, in order."""
    flags = []
    for walk_name in key.walks:
        if walk_name not in walks:
            raise GlueError(f"key `{key.name}` names walk `{walk_name}`, which the plan lacks")
        flags.append(walk_flags(walks[walk_name], key.node))
    batch_sizes = sorted({b for family in key.captures for b in family.batch_sizes})
    token_buckets = sorted({t for f in key.captures for t in (
        f.token_buckets if f.kind == "packed" else [b * f.tokens_per_row for b in f.batch_sizes])})
    max_rows = max([entry.cap for entry in key.mixtures] + batch_sizes + [1])
    return (
        key.name, key.node, tuple(key.walks), page_size, max_rows, _next_power_of_two(max_rows),
        tuple(i for i, f in enumerate(flags) if f.is_device_loop),
        tuple(i for i, f in enumerate(flags) if f.is_stream),
        tuple(i for i, f in enumerate(flags) if f.is_host),
        tuple(batch_sizes), tuple(token_buckets),
    )


def walk_flags(walk: WalkPlan, node: str) -> WalkFlags:
    """Where the token sampled by `node` in `walk` goes (read from the walk's call table)."""
    is_device_loop = is_stream = is_host = False
    for call in walk.calls:
        if call.node != node:
            continue
        for edge in call.edges:
            is_device_loop |= edge.is_device
            is_stream |= edge.dest_kind == "stream"
            is_host |= not edge.is_device
        is_host |= call.stop_loop is not None  # a stop check reads the token on the host
    return WalkFlags(is_device_loop, is_stream, is_host)


def _walk_test(indices: tuple[int, ...], var: str) -> str:
    """Triton expression: is walk index `var` one of `indices` (rendered only when non-empty)."""
    if len(indices) == 1:
        return f"{var} == {indices[0]}"
    return " | ".join(f"({var} == {i})" for i in indices)


def _unique_ident(key_name: str, used: set[str]) -> str:
    base = re.sub(r"\W+", "_", key_name).strip("_").lower() or "key"
    if base[0].isdigit():
        base = "k_" + base
    ident, suffix = base, 2
    while ident in used:
        ident, suffix = f"{base}_{suffix}", suffix + 1
    used.add(ident)
    return ident


def _mask(indices: tuple[int, ...]) -> int:
    return sum(1 << i for i in indices)


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
