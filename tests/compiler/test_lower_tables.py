"""Walk tables (plan schema 3): golden tables for a small spec with a loop (a loop-back, an output
and an accumulated edge), a parallel section and a stream, and the rules the lowering follows."""
from compiler_helpers import checked_plan

from mstar.plan.schema import EdgePlan, NextPlan, WalkPlan

GOLDEN_SPEC = """
model golden
param steps = 3

node A kv(layers=2, kv_heads=2, qo_heads=4, head_dim=16, hidden=64, vocab=128) {
    in text_inputs: tokens prompt text
    in x: tokens
    out x: tokens
    out y: tokens
    out z: tokens
    out s: tokens
}
node B stateless audio_codec {
    in y: tokens
    in z: tokens
    out wave: audio
}
node C stateless audio_codec {
    in z: tokens
    out tail: audio
}
node S stateless audio_codec {
    in s stream: tokens
    out chunk: audio
}

walk gen {
    A(text_inputs) -> x: A
    loop gen_loop max=steps stop {
        A(x) -> x: A device -> y: B -> z: B -> z: C -> s: S stream
    } outputs z accumulate y
    parallel {
        B(y, z) -> wave: client audio
        C(z) -> tail: client audio
    }
}

walk speak {
    S(s) -> chunk: client audio
}

partition P = gen
partition Q = speak <- P.s fixed(2)
"""

GOLDEN_CONFIG = """
model: golden
max_seq_len: 256
node_groups:
  - node_names: [A, B, C]
    ranks: [0]
  - node_names: [S]
    ranks: [1]
"""

# One line per table row: calls (inputs, edges, then, loop / stop loop, ranks), loops (bound,
# stop, body, exit, cleared slots, exits), joins, slots.
GOLDEN_TABLES = """\
walk gen (P) start: calls 0
call 0 A: text_inputs <- prompt(text) | x:node A => slot 0 | then start calls 1 loops 0 | loop - stop - | ranks [[0]]
call 1 A: x <- slots 0 else none | x:node A device => loop_back 0 slot 0; y:node B => loop_accumulate 0 exit 0; \
z:node B => loop_output 0 exit 1; z:node C => loop_output 0 exit 2; s:stream S->Q => sink | then loop_end 0 | \
loop 0 stop 0 | ranks [[0]]
call 2 B: y <- slots 1 else none; z <- slots 2 else none | wave:client audio => sink | then join 0 | loop - stop - \
| ranks [[0]]
call 3 C: z <- slots 3 else none | tail:client audio => sink | then join 0 | loop - stop - | ranks [[0]]
loop 0 gen_loop max 3 stop | body start calls 1 | then start calls 2 3 joins 0 | clears - | exits accumulate y \
(y:node B => slot 1); output z (z:node B => slot 2); output z (z:node C => slot 3)
join 0: 2 members, then walk_end
slots: A.x, B.y, B.z, C.z
walk speak (Q) start: calls 0
call 0 S: s <- stream | chunk:client audio => sink | then walk_end | loop - stop - | ranks [[1]]
"""


def _next(then: NextPlan) -> str:
    if then.kind != "start":
        return then.kind + ("" if then.target is None else f" {then.target}")
    text = "start calls " + " ".join(map(str, then.calls))
    if then.loops:
        text += " loops " + " ".join(map(str, then.loops))
    if then.joins:
        text += " joins " + " ".join(map(str, then.joins))
    return text


def _edge(edge: EdgePlan) -> str:
    dest = f"{edge.dest_kind} {edge.modality}" if edge.dest_kind == "client" else f"{edge.dest_kind} {edge.dest}"
    if edge.dest_kind == "stream":
        dest = f"stream {edge.dest}->{edge.stream_partition}"
    flags = "".join(f" {flag}" for flag, on in (("device", edge.is_device), ("persist", edge.is_persist)) if on)
    action = edge.action
    if edge.action == "slot":
        return f"{edge.name}:{dest}{flags} => slot {edge.slot}"
    if edge.loop is not None:
        action += f" {edge.loop}"
    if edge.slot is not None:
        action += f" slot {edge.slot}"
    if edge.exit is not None:
        action += f" exit {edge.exit}"
    return f"{edge.name}:{dest}{flags} => {action}"


def _render(walk: WalkPlan) -> list[str]:
    lines = [f"walk {walk.name} ({walk.partition}) start: {_next(walk.start).removeprefix('start ')}"]
    for index, call in enumerate(walk.calls):
        inputs = "; ".join(
            f"{i.name} <- " + (f"slots {' '.join(map(str, i.slots))} else " if i.slots else "")
            + (f"prompt({i.prompt})" if i.source == "prompt" else i.source) + (" (waits)" if i.is_wait else "")
            for i in call.inputs)
        loop = "-" if call.loop is None else str(call.loop)
        stop = "-" if call.stop_loop is None else str(call.stop_loop)
        lines.append(f"call {index} {call.node}: {inputs} | {'; '.join(_edge(e) for e in call.edges)} | "
                     f"then {_next(call.then)} | loop {loop} stop {stop} | ranks {call.instances}")
    for index, loop in enumerate(walk.loops):
        exits = "; ".join(f"{x.kind} {x.name} (" + (_edge(x.edge) if x.edge else f"slot {x.slot}") + ")"
                          for x in loop.exits)
        lines.append(f"loop {index} {loop.name} max {loop.max_iters}{' stop' if loop.has_stop else ''} | "
                     f"body {_next(loop.body)} | then {_next(loop.then)} | "
                     f"clears {' '.join(map(str, loop.cleared_slots)) or '-'} | exits {exits or '-'}")
    for index, join in enumerate(walk.joins):
        lines.append(f"join {index}: {join.num_members} members, then {_next(join.then)}")
    if walk.slots:
        lines.append("slots: " + ", ".join(walk.slots))
    return lines


def _plan(spec: str = GOLDEN_SPEC, config: str = GOLDEN_CONFIG):
    return checked_plan(spec, config)


def test_golden_walk_tables():
    text = "\n".join(line for walk in _plan().walks for line in _render(walk)) + "\n"
    expected = GOLDEN_TABLES.replace("\\\n", "")
    assert text == expected, "\n" + text


def test_counted_outputs_and_stop_loops_follow_the_spec():
    spec = GOLDEN_SPEC.replace("-> wave: client audio", "-> wave: client audio count_tokens")
    gen = _plan(spec).walks[0]
    assert [c.counted for c in gen.calls] == [[], [], ["wave"], []]
    # A partition without count_tokens edges counts the text it sends to the client: none here.
    assert all(not c.counted for c in _plan().walks[0].calls)


PARALLEL_FEED = """
model feed
node E stateless vision_encoder {
    in image_inputs: media prompt image
    out emb: embeddings
}
node F stateless vision_encoder {
    in image_inputs: media prompt image
    out emb2: embeddings
}
node L kv(layers=2, kv_heads=2, qo_heads=4, head_dim=16, hidden=64, vocab=128) {
    in text_inputs: tokens prompt text
    in emb: embeddings
    in emb2: embeddings
    out new_token: tokens
}
walk w {
    parallel {
        E(image_inputs) -> emb: L
        sequential {
            F(image_inputs) -> emb2: L
            L(emb, emb2) -> new_token: client text
        }
    }
    L(text_inputs, emb) -> new_token: client text
}
partition P = w
"""

FEED_CONFIG = """
model: feed
max_seq_len: 256
node_groups:
  - node_names: [E, F, L]
    ranks: [0]
"""


def test_an_input_fed_by_a_parallel_sibling_waits_for_it():
    (walk,) = _plan(PARALLEL_FEED, FEED_CONFIG).walks
    calls = {(c.node, tuple(i.name for i in c.inputs)): c for c in walk.calls}
    inner = calls[("L", ("emb", "emb2"))]
    emb, emb2 = inner.inputs
    assert emb.is_wait and emb.slots  # E runs beside it: wait for E's edge
    assert not emb2.is_wait and emb2.slots  # F ran before it in its own sequence
    after = calls[("L", ("text_inputs", "emb"))]
    assert not any(i.is_wait for i in after.inputs)  # the parallel ended before it
    assert after.inputs[0].source == "prompt" and after.inputs[0].prompt == "text"
    encoder = calls[("E", ("image_inputs",))]
    assert encoder.inputs[0].source == "prompt" and encoder.inputs[0].prompt == "image"


def test_data_parallel_replicas_are_instances_and_the_policy_is_in_the_plan():
    config = GOLDEN_CONFIG.replace("ranks: [0]", "ranks: [0, 2]") + "replica_policy: round_robin\n"
    plan = _plan(config=config)
    assert plan.deployment.replica_policy == "round_robin"
    assert {tuple(map(tuple, c.instances)) for c in plan.walks[0].calls} == {((0,), (2,))}
