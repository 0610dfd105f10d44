"""Pass 6, lower: a checked spec + its deployment -> the plan tables (mstar/plan/schema.py).

In:  a `Spec` that passed resolve/check_graph, a `Deployment` that passed check_deployment and
     check_combine, and the `Header` the driver built (emit fills in the glue hash later).
Out: `run(spec, deployment, header) -> Plan`; nodes, walks, partitions and keys in declaration
     order, lookup tables sorted, so two runs give equal plans and a renaming moves nothing.

    params      name -> value
    nodes       engine, model kind, dims (the spec's node args), input and output roles, KV
                sequences with each walk's reads / writes, guidance, recurrent state slots
    walks       walk tables: calls with input sources, edge actions, next calls, instances;
                joins; loops (lower_walks builds section trees, lower_tables the tables)
    partitions  stages, initial walk, streams (lower_walks)
    deployment  KV pools, max_seq_len, admission limit, capture budget, follower fairness,
                replica policy
    workers     per rank: placements, keys + mixtures, speculation, TP groups (lower_workers)

Defaults applied here (documented in docs/plan.md): KV pools (with their prefix cache and the
walks that may start after a cached prefix, chunking.py) as `Deployment.kv_pool_for` resolves
them (kv_pool.nodes, kv_pool, kv_cache, then page 128 x 2048 pages); recurrent state
slots = the deployment's `recurrent_state_slots` (else `max_concurrent_requests`, else
`deployment.UNBOUNDED_ROWS`, 256) plus one padding sink; a walk with neither a cap nor a
capture is capped at `max_concurrent_requests`, else 256.
"""
from __future__ import annotations

from typing import Optional

from mstar.compiler.capture_keys import DEFAULT_KV_SEQUENCE  # a kv node's one sequence when none is declared
from mstar.compiler.check_prompt_format import PROMPT_FIELD, TOKEN_LIST_ARGS, template_fields
from mstar.compiler.check_roles import model_kind
from mstar.compiler.chunking import offload_host_pages, prefix_cache_mode, prefix_walks
from mstar.compiler.chunk_cost import with_chunk_costs
from mstar.compiler.deployment import Deployment
from mstar.compiler.lower_tables import lower_walk_tables
from mstar.compiler.lower_walks import lower_partitions, lower_walks
from mstar.compiler.lower_workers import lower_workers
from mstar.compiler.node_decl import arg_values, recurrent_state
from mstar.lang import ast
from mstar.plan.instances import call_instances
from mstar.plan.schema import (
    CrossKvPlan,
    DeploymentPlan,
    GuidancePlan,
    Header,
    InputPlan,
    KvAccessPlan,
    KvPoolPlan,
    NodePlan,
    OutputPlan,
    Plan,
    PromptFormatPlan,
    SubModelPlan,
)


def _kv_access(spec: ast.Spec, node: ast.NodeDecl, labels: list[str]) -> list[KvAccessPlan]:
    """Per walk that calls a kv node, in walk order: the spec's `kv W ...` line, else the first
    sequence (read by an image-flow walk, written by any other)."""
    if node.engine != "kv":
        return []
    stated = {a.walk: a for a in node.kv_access}
    flows = {d.name for d in node.inputs if d.role == "flow_latents"}
    access = []
    for walk in spec.walks:
        calls = [c for c in _calls(walk.body) if c.node == node.name]
        if not calls:
            continue
        if walk.name in stated:
            access.append(KvAccessPlan(walk=walk.name, reads=list(stated[walk.name].reads),
                                       writes=list(stated[walk.name].writes)))
        elif any(flows & set(c.inputs) for c in calls):
            access.append(KvAccessPlan(walk=walk.name, reads=[labels[0]]))
        else:
            access.append(KvAccessPlan(walk=walk.name, writes=[labels[0]]))
    return access


def _calls(sections: list):
    for section in sections:
        if isinstance(section, ast.Call):
            yield section
        else:
            yield from _calls(section.body)


def lower_nodes(spec: ast.Spec, deployment) -> list[NodePlan]:
    """Nodes in declaration order (a node's position is what the runtime seeds its weights by)."""
    nodes = []
    for node in spec.nodes:
        kind = model_kind(node)
        # check_roles refused a node without a model kind or an input without a role
        assert kind is not None and all(i.role is not None for i in node.inputs)
        args = arg_values(node.args)
        labels = list(node.kv_sequences.labels) if node.kv_sequences else [DEFAULT_KV_SEQUENCE]
        nodes.append(
            NodePlan(
                name=node.name,
                engine=node.engine,
                model_kind=kind,
                dims=dict(sorted(args.items())),
                kv_sequences=labels,
                kv_access=_kv_access(spec, node, labels),
                cross_kv=[CrossKvPlan(label=c.label, source=c.source, num_tokens=c.num_tokens)
                          for c in node.cross_kv],
                guidance=[GuidancePlan(label=g.label, drops=g.drops, scale=g.scale) for g in node.guidance],
                bidirectional_walks=sorted(set(node.bidirectional.walks)) if node.bidirectional else [],
                recurrent=recurrent_state(node, deployment),
                submodels=[SubModelPlan(name=sub.name, dims=dict(sorted((a.name, a.value) for a in sub.args)),
                                        walks=sorted(set(sub.walks)), samples=sub.samples, depth=sub.depth)
                           for sub in node.submodels],
                inputs=sorted(i.name for i in node.inputs if not i.is_stream),
                stream_inputs=sorted(i.name for i in node.inputs if i.is_stream),
                input_roles=[InputPlan(name=i.name, role=i.role, prompt=i.prompt)
                             for i in node.inputs if i.role is not None],
                outputs=[OutputPlan(name=o.name, role=o.role) for o in node.outputs],
                prompt_format=_prompt_format(node.prompt_format),
                is_tp=node.is_tp,
                is_async=node.is_async,
            )
        )
    return nodes


def _prompt_format(decl: Optional[ast.PromptFormat]) -> Optional[PromptFormatPlan]:
    if decl is None:
        return None
    lists = {a.name: a.value for a in decl.args if a.name in TOKEN_LIST_ARGS and isinstance(a.value, list)}
    fields = template_fields(decl.template) or []  # check_prompt_format refused a template it cannot parse
    return PromptFormatPlan(
        template=decl.template,
        before=lists.get("before", []),
        after=lists.get("after", []),
        fields=[f for f in fields if f != PROMPT_FIELD],
        defaults={a.name: a.value for a in decl.args if a.name not in TOKEN_LIST_ARGS and isinstance(a.value, str)},
    )


def lower_deployment(spec: ast.Spec, deployment: Deployment) -> DeploymentPlan:
    max_seq_len = deployment.pool_max_seq_len()
    pools = []
    for node in spec.nodes:
        if node.engine == "kv":
            pool = deployment.kv_pool_for(node.name)
            cache = prefix_cache_mode(node, deployment.prefix_cache_for(node.name))
            pools.append(KvPoolPlan(node=node.name, page_size=pool.page_size, num_pages=pool.num_pages,
                                    max_seq_len=max_seq_len, prefix_cache=cache,
                                    prefix_walks=prefix_walks(node, spec.walks) if cache == "pages" else [],
                                    host_pages=offload_host_pages(node, deployment.host_pages_for(node.name))))
    # model_kwargs of the reference YAML are read by the deployment loader but not lowered: no
    # part of the runtime has a use for them (a checkpoint's own config.json gives its dims).
    return DeploymentPlan(
        max_seq_len=deployment.max_seq_len,
        max_concurrent_requests=deployment.max_concurrent_requests,
        capture_memory_budget_bytes=deployment.capture_memory_budget_bytes,
        max_consecutive_follower_batches=deployment.max_consecutive_follower_batches,
        replica_policy=deployment.replica_policy,
        kv_pools=sorted(pools, key=lambda p: p.node),
    )


def run(spec: ast.Spec, deployment: Deployment, header: Header) -> Plan:
    """Every table of the plan for `spec` placed by `deployment` (see the module docstring)."""
    params = ast.values_by_name(spec.params)
    trees = lower_walks(spec, params)
    partitions = lower_partitions(spec)
    nodes = lower_nodes(spec, deployment)
    workers = with_chunk_costs(lower_workers(spec, deployment, trees, deployment.row_limit()), nodes, deployment)
    return Plan(
        header=header,
        params=dict(sorted(params.items())),
        nodes=nodes,
        walks=lower_walk_tables(trees, partitions, nodes, call_instances(workers)),
        partitions=partitions,
        deployment=lower_deployment(spec, deployment),
        workers=workers,
    )
