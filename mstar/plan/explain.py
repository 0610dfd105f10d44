"""`mstarc explain PLAN`: a plan's tables printed for people (rich tables).

In:  a loaded `Plan`. Out: `explain_text(plan, width) -> str` (plain text, no colour codes), or
`print_plan(plan, console)` onto a rich Console. Reads the plan only; imports neither the
language nor the compiler.
"""
from __future__ import annotations

import io
from typing import Optional

from rich.console import Console, ConsoleRenderable, RichCast
from rich.style import Style
from rich.table import Table
from rich.text import Text

from mstar.plan.schema import CaptureFamily, EdgePlan, InputSourcePlan, KeyPlan, NextPlan, Plan, WalkPlan, WorkerPlan

MIB = 1024 * 1024


class _Table(Table):
    """A table whose cells are plain text: `[persist]` is data here, not rich markup."""

    def add_row(self, *renderables: ConsoleRenderable | RichCast | str | None, style: str | Style | None = None,
                end_section: bool = False) -> None:
        cells = (Text(c) if isinstance(c, str) else c for c in renderables)
        super().add_row(*cells, style=style, end_section=end_section)


def _table(title: str, *columns: str) -> Table:
    table = _Table(title=Text(title), title_justify="left", show_lines=False, pad_edge=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _is_on_device(walk: WalkPlan, loop: int) -> bool:
    """A loop whose loop-back edges all stay on the device (and that has some)."""
    backs = [e for call in walk.calls for e in call.edges if e.action == "loop_back" and e.loop == loop]
    return bool(backs) and all(e.is_device for e in backs)


def _edge_text(edge: EdgePlan, walk: WalkPlan) -> str:
    dest = edge.dest or edge.dest_kind
    if edge.dest_kind == "stream":
        dest = f"{edge.dest} stream->{edge.stream_partition}"
    flags = [
        name
        for name, on in (
            ("persist", edge.is_persist),
            ("device", edge.is_device),
        )
        if on
    ]
    if edge.modality:
        flags.append(edge.modality)
    text = f"{edge.name}: {dest}" + (f" [{', '.join(flags)}]" if flags else "")
    if edge.action == "slot":
        return f"{text} => slot {edge.slot}"
    if edge.action == "loop_back":
        return f"{text} => loop-back of {_loop_name(walk, edge.loop)} into slot {edge.slot}"
    if edge.action in ("loop_output", "loop_accumulate"):
        word = "output" if edge.action == "loop_output" else "accumulated"
        return f"{text} => {word} of {_loop_name(walk, edge.loop)} (exit {edge.exit})"
    return text


def _loop_name(walk: WalkPlan, index: Optional[int]) -> str:
    # A loaded plan names a loop wherever its action needs one (plan/references.py checks it).
    return "?" if index is None else walk.loops[index].name


def _input_text(source: InputSourcePlan) -> str:
    slots = " or ".join(f"slot {s}" for s in source.slots)
    if source.is_wait:
        return f"{source.name} <- {slots} (waits)"
    return f"{source.name} <- " + (f"{slots}, else " if slots else "") + source.source


def _next_text(then: NextPlan, walk: WalkPlan) -> str:
    if then.kind == "start":
        parts = [f"enter {walk.loops[i].name}" for i in then.loops]
        parts += [f"arm join {i}" for i in then.joins]
        parts.append("calls " + " ".join(map(str, then.calls)))
        return "; ".join(parts)
    if then.kind == "join":
        return f"join {then.target}"
    if then.kind == "loop_end":
        return f"end iteration of {_loop_name(walk, then.target)}"
    return "walk ends"


def _walk_tables(console: Console, walk: WalkPlan) -> None:
    console.print(Text(f"walk {walk.name} (partition {walk.partition}): starts with {_next_text(walk.start, walk)}"))
    table = _table(f"walk {walk.name}: calls", "#", "node", "inputs", "edges", "then", "loop", "ranks")
    for index, call in enumerate(walk.calls):
        loop_text = "" if call.loop is None else walk.loops[call.loop].name
        if call.stop_loop is not None:
            loop_text += f" (stop ends {walk.loops[call.stop_loop].name})"
        counted = f"; counts {', '.join(call.counted)}" if call.counted else ""
        table.add_row(
            str(index), call.node, "; ".join(_input_text(i) for i in call.inputs),
            "; ".join(_edge_text(e, walk) for e in call.edges) + counted, _next_text(call.then, walk), loop_text,
            " | ".join(" ".join(map(str, instance)) for instance in call.instances),
        )
    console.print(table)
    if walk.loops:
        table = _table(f"walk {walk.name}: loops", "name", "max", "stop", "body", "then", "clears", "exits")
        for index, loop in enumerate(walk.loops):
            exits = "; ".join(
                f"{x.kind} {x.name} -> " + (f"slot {x.slot}" if x.edge is None else _edge_text(x.edge, walk))
                for x in loop.exits
            )
            table.add_row(
                loop.name + (" (on device)" if _is_on_device(walk, index) else ""), str(loop.max_iters),
                "yes" if loop.has_stop else "no", _next_text(loop.body, walk), _next_text(loop.then, walk),
                " ".join(map(str, loop.cleared_slots)), exits,
            )
        console.print(table)
    if walk.joins:
        table = _table(f"walk {walk.name}: parallel joins", "#", "members", "then")
        for index, join in enumerate(walk.joins):
            table.add_row(str(index), str(join.num_members), _next_text(join.then, walk))
        console.print(table)
    if walk.slots:
        console.print(Text(f"walk {walk.name} slots: " + ", ".join(f"{i} {s}" for i, s in enumerate(walk.slots))))


def _key_table(key: KeyPlan) -> Table:
    limits = ", ".join(f"{w} <= {n}" for w, n in sorted(key.rows_limits.items()))
    title = f"key {key.name} (walks: {', '.join(key.walks)}" + (f"; rows {limits}" if limits else "") + ")"
    table = _table(title, "mask", "walks", "cap", "capture", "attention")
    for entry in key.mixtures[1:]:
        table.add_row(
            f"{entry.mask} ({entry.mask:0{len(key.walks)}b})",
            " + ".join(entry.walks),
            str(entry.cap),
            ", ".join([entry.capture, *entry.also_captures]) if entry.capture else "eager",
            entry.attention,
        )
    return table


def _family_kind(family: CaptureFamily) -> str:
    """`packed`, with the family's options as the spec writes them (`guided` / `unguided` with its
    labels, `piecewise`, `eager_above`, `unroll_prompts`)."""
    words: list[str] = [family.kind]
    if family.guidance != "any":
        words.append(f"{family.guidance} [{', '.join(family.labels)}]")
    if family.is_piecewise:
        words.append("piecewise")
    if family.is_eager_above:
        words.append("eager_above")
    if family.unroll_prompts:
        words.append(f"unroll_prompts={family.unroll_prompts}")
    return " ".join(words)


def _worker(console: Console, worker: WorkerPlan) -> None:
    console.rule(Text(f"worker rank {worker.rank}  (capture memory {worker.capture_memory_bytes / MIB:.1f} MiB)"))
    table = _table("placements", "node/walk", "key")
    for pair in worker.placements:
        table.add_row(pair, worker.walk_to_key[pair])
    console.print(table)
    for key in worker.keys:
        console.print(_key_table(key))
    families = [f for key in worker.keys for f in key.captures]
    if families:
        table = _table("capture families", "name", "kind", "batch sizes", "token buckets", "graphs", "MiB")
        for f in families:
            table.add_row(
                f.name, _family_kind(f), " ".join(map(str, f.batch_sizes)),
                " ".join(map(str, f.token_buckets)) or f"{f.tokens_per_row}/row",
                str(f.num_graphs), f"{f.memory_bytes / MIB:.1f}",
            )
        console.print(table)
    table = _table("speculation", "node/walk", "can speculate", "mixes walks")
    for s in worker.speculation:
        table.add_row(f"{s.node}/{s.walk}", "yes" if s.can_speculate else "no", "yes" if s.mixes_walks else "no")
    console.print(table)
    if worker.tp_groups:
        table = _table("TP groups", "node", "walks", "ranks", "tp x sp", "leader")
        for g in worker.tp_groups:
            table.add_row(g.node, " ".join(g.walks), " ".join(map(str, g.ranks)),
                          f"{g.tp_size} x {g.sp_size}", str(g.leader))
        console.print(table)


def print_plan(plan: Plan, console: Console) -> None:
    _header(plan, console)
    _nodes(plan, console)
    for walk in plan.walks:
        _walk_tables(console, walk)
    _partitions(plan, console)
    _deployment(plan, console)
    for worker in plan.workers:
        _worker(console, worker)


def _header(plan: Plan, console: Console) -> None:
    h = plan.header
    console.rule(Text(f"plan {h.model} / {h.deployment}"))
    console.print(Text(
        f"schema {h.schema_version}, mstarc {h.compiler_version}\n"
        f"spec {h.spec_path} ({h.hashes.spec[:12]})\n"
        f"deployment {h.deployment_path} ({h.hashes.deployment[:12]})\n"
        f"glue {h.glue_path} ({h.hashes.glue[:12]})"
    ))
    if plan.params:
        console.print(Text("params: " + ", ".join(f"{k} = {v}" for k, v in plan.params.items())))


def _nodes(plan: Plan, console: Console) -> None:
    table = _table("nodes", "name", "engine", "state", "inputs", "outputs", "flags")
    for n in plan.nodes:
        state = ""
        if n.engine == "kv":
            state = "kv " + " ".join(n.kv_sequences)
            state += "".join(f"; cross_kv {c.label} from {c.source} ({c.num_tokens} tokens)" for c in n.cross_kv)
            state += "".join(f"; guidance {g.label} drops {g.drops} x{g.scale:g}" for g in n.guidance)
        if n.recurrent:
            state += f"; recurrent {n.recurrent.num_slots} slots"
        flags = " ".join(f for f, on in (("tp", n.is_tp), ("no_speculation", not n.is_async)) if on)
        inputs = ", ".join(f"{r.name}{' stream' if r.name in n.stream_inputs else ''}: {r.role}"
                           + (f" prompt {r.prompt}" if r.prompt else "") for r in n.input_roles)
        outputs = ", ".join(f"{o.name}: {o.role}" for o in n.outputs)
        table.add_row(n.name, f"{n.engine} ({n.model_kind})", state, inputs, outputs, flags)
    console.print(table)
    for n in plan.nodes:
        for access in n.kv_access:
            reads = f" reads {' '.join(access.reads)}" if access.reads else ""
            writes = f" writes {' '.join(access.writes)}" if access.writes else ""
            console.print(Text(f"  {n.name} kv {access.walk}{reads}{writes}"))
    for n in plan.nodes:
        if n.dims:
            console.print(Text(f"  {n.name} dims: " + " ".join(f"{k}={v}" for k, v in n.dims.items())))
        for sub in n.submodels:
            widths = " ".join(f"{k}={v}" for k, v in sub.dims.items())
            samples = f" samples {sub.samples} depth={sub.depth}" if sub.samples is not None else ""
            console.print(Text(f"  {n.name} submodel {sub.name} ({widths}){samples} for {' '.join(sub.walks)}"))


def _partitions(plan: Plan, console: Console) -> None:
    table = _table("partitions", "name", "stages", "initial walk", "streams in")
    for p in plan.partitions:
        stages = " -> ".join(" | ".join(s.walks) + ("?" if s.is_optional else "") for s in p.stages)
        streams = "; ".join(
            f"{s.producer_partition}.{s.edge} -> {s.consumer_node} {s.policy.kind}({s.policy.size}"
            + (f", stride={s.policy.stride}" if s.policy.stride is not None else "")
            + (f", context={s.policy.context}" if s.policy.context is not None else "")
            + (", continue" if s.policy.is_continue_after_done else "") + ")"
            for s in p.streams
        )
        table.add_row(p.name, stages, p.initial_walk or "(stream-triggered)", streams)
    console.print(table)


def _deployment(plan: Plan, console: Console) -> None:
    d = plan.deployment
    budget = "none" if d.capture_memory_budget_bytes is None else f"{d.capture_memory_budget_bytes / MIB:.0f} MiB"
    console.print(Text(
        f"deployment: max_seq_len {d.max_seq_len}, max concurrent requests "
        f"{d.max_concurrent_requests or 'unlimited'}, capture budget {budget}, "
        f"follower batches in a row {d.max_consecutive_follower_batches}, replicas by {d.replica_policy}"
    ))
    table = _table("KV pools", "node", "page size", "pages", "max seq len")
    for pool in d.kv_pools:
        table.add_row(pool.node, str(pool.page_size), str(pool.num_pages), str(pool.max_seq_len))
    console.print(table)


def explain_text(plan: Plan, width: int = 120) -> str:
    """The explanation as plain text."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    print_plan(plan, console)
    return buffer.getvalue()
