"""Hypothesis strategies for random `.mw` ASTs: every tree the grammar can write.

Names avoid the language's keywords (a keyword is read as a keyword wherever one may stand) and
the constraints of the written form are kept: a client edge has a modality and no other edge has
one, label / walk / stage lists are not empty, chunk policies carry the fields of their kind.
"""
from __future__ import annotations

from hypothesis import strategies as st

from mstar.lang import ast
from mstar.lang.parser import keywords

KEYWORDS = keywords()
MAX_INT = 2**63 - 1

_FIRST = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
names = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from(_FIRST),
    st.text(alphabet=_FIRST + "0123456789", max_size=7),
).filter(lambda n: n not in KEYWORDS)
counts = st.integers(min_value=0, max_value=MAX_INT) | st.integers(min_value=0, max_value=100)
signed = st.integers(min_value=-MAX_INT, max_value=MAX_INT)
small_lists = lambda strategy: st.lists(strategy, max_size=2)  # noqa: E731
name_lists = st.lists(names, min_size=1, max_size=2)

arg_values = st.one_of(
    signed,
    st.floats(allow_nan=False, allow_infinity=False),
    names,
    st.text(max_size=8),
    small_lists(signed),
)
args = small_lists(st.builds(ast.Arg, name=names, value=arg_values))


def captures(walk):
    return st.builds(
        ast.CaptureDecl,
        walk=walk,
        family=st.sampled_from(["batched", "packed"]),
        batch=small_lists(counts),
        tokens=small_lists(counts),
        tokens_per_row=counts,
        guidance=st.none() | st.sampled_from(["guided", "unguided"]),
        labels=st.just([]) | name_lists,
        is_eager_above=st.booleans(),
        is_piecewise=st.booleans(),
    )


combines = st.builds(
    ast.CombineDecl,
    name=names,
    walks=name_lists,
    cap=st.none() | counts,
    rows=small_lists(st.builds(ast.RowsLimit, walk=names, limit=counts)),
    capture=st.none() | captures(st.none()),
    attention=st.none() | st.sampled_from(["split", "packed"]),
)

@st.composite
def inputs(draw):
    role = draw(st.none() | st.sampled_from(ast.INPUT_ROLES))
    prompt = draw(st.none() | st.sampled_from(ast.MODALITIES)) if role is not None else None
    return ast.InputDecl(name=draw(names), is_stream=draw(st.booleans()), role=role, prompt=prompt)


scales = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False) | st.integers(0, 9).map(float)
kv_accesses = st.builds(ast.KvAccess, walk=names, reads=small_lists(names), writes=small_lists(names)).filter(
    lambda a: a.reads or a.writes)


@st.composite
def engines(draw):
    engine = draw(st.sampled_from(["kv", "stateless"]))
    kind = draw(st.none() | st.sampled_from(ast.MODEL_KINDS)) if engine == "stateless" else None
    return engine, kind


nodes = st.builds(
    lambda engine, **fields: ast.NodeDecl(engine=engine[0], model_kind=engine[1], **fields),
    name=names,
    engine=engines(),
    args=args,
    is_tp=st.booleans(),
    is_async=st.booleans(),
    kv_sequences=st.none() | st.builds(ast.KvSequences, labels=name_lists),
    cross_kv=small_lists(st.builds(ast.CrossKv, label=names, source=names, num_tokens=counts)),
    guidance=small_lists(st.builds(ast.GuidanceDecl, label=names, drops=st.sampled_from(ast.MODALITIES),
                                   scale=scales)),
    kv_access=small_lists(kv_accesses),
    bidirectional=st.none() | st.builds(ast.Bidirectional, walks=name_lists),
    states=small_lists(st.builds(ast.StateDecl, kind=st.just("recurrent"), args=args)),
    submodels=small_lists(st.builds(ast.SubModelDecl, name=names, args=args, walks=name_lists)
                          | st.builds(ast.SubModelDecl, name=names, args=args, walks=name_lists, samples=names,
                                      depth=counts)),
    inputs=small_lists(inputs()),
    outputs=small_lists(st.builds(ast.OutputDecl, name=names, role=st.sampled_from(ast.OUTPUT_ROLES))),
    caps=small_lists(st.builds(ast.CapDecl, walk=names, value=counts)),
    batching=small_lists(st.builds(ast.BatchingDecl, walk=names,
                                   rules=st.lists(st.sampled_from(ast.BATCH_RULES), min_size=1, max_size=3))),
    captures=small_lists(captures(st.none() | names)),
    capture_replays=small_lists(st.builds(ast.CaptureReplay, walk=names, source=names)),
    combines=small_lists(combines),
    prompt_format=st.none() | st.builds(ast.PromptFormat, template=st.text(max_size=12), args=args),
)


@st.composite
def edges(draw):
    is_client = draw(st.booleans())
    return ast.Edge(
        name=draw(names),
        dest="client" if is_client else draw(names),
        modality=draw(st.sampled_from(ast.CLIENT_MODALITIES)) if is_client else None,
        is_persist=draw(st.booleans()),
        is_stream=draw(st.booleans()),
        is_device=draw(st.booleans()),
        is_count_tokens=draw(st.booleans()),
    )


calls = st.builds(ast.Call, node=names, inputs=small_lists(names), edges=small_lists(edges()))


def _extend(children):
    body = small_lists(children)
    return st.one_of(
        st.builds(ast.Parallel, body=body),
        st.builds(ast.Sequential, body=body),
        st.builds(
            ast.Loop,
            name=st.none() | names,
            max_iters=counts | names,
            count=st.none() | names,
            has_stop=st.booleans(),
            body=body,
            outputs=small_lists(names),
            accumulate=small_lists(names),
        ),
    )


sections = st.recursive(calls, _extend, max_leaves=4)
walks = st.builds(ast.Walk, name=names, body=small_lists(sections))

@st.composite
def sequence_stages(draw):
    """A stage whose alternatives are sequences of walks, at least one of two or more."""
    sequences = draw(st.lists(st.lists(names, min_size=1, max_size=3), min_size=1, max_size=3)
                     .filter(lambda seqs: any(len(s) > 1 for s in seqs)))
    return ast.Stage(walks=[w for s in sequences for w in s], is_optional=draw(st.booleans()),
                     sequence_lengths=[len(s) for s in sequences])


policies = st.one_of(
    st.builds(ast.ChunkPolicy, kind=st.just("window"), size=counts, stride=st.none() | counts),
    st.builds(ast.ChunkPolicy, kind=st.just("left_context"), size=counts, context=counts),
    st.builds(ast.ChunkPolicy, kind=st.just("fixed"), size=counts, is_continue_after_done=st.booleans()),
)
partitions = st.builds(
    ast.Partition,
    name=names,
    stages=small_lists(st.builds(ast.Stage, walks=name_lists, is_optional=st.booleans()) | sequence_stages()),
    repeat=st.none() | st.builds(ast.Repeat, value=names, max_rounds=counts | names),
    streams=small_lists(st.builds(ast.StreamSource, partition=names, edge=names, policy=policies,
                                  keep=st.none() | st.tuples(counts, counts))),
)

specs = st.builds(
    ast.Spec,
    model=names,
    params=small_lists(st.builds(ast.Param, name=names, value=signed)),
    nodes=small_lists(nodes),
    walks=small_lists(walks),
    partitions=small_lists(partitions),
)
