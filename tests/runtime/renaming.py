"""Consistent renaming of every name a spec's author chooses, on the parsed spec and the deployment.

`rename_spec(spec) -> (renamed spec, mapping)`: the model, params, nodes, inputs, outputs (edge and
loop output names, stream sources), walks, loops, combined walks, partitions, KV sequence labels,
cross_kv pools (label and source input), guidance labels and capture labels, each through one mapping old -> new.
The new names sort in the reverse order of the old ones, so anything that still orders by name
moves. `rename_deployment(data, mapping)` renames the names a deployment YAML holds (node and walk
names, the model, per-node and per-walk keys) by its structure, never by text replacement. Reserved
destinations (`conductor`, `client`) and argument names are not the author's and stay.
"""
from __future__ import annotations

from typing import Any

from mstar.lang import ast

RESERVED_DESTS = ("conductor", "client")


def _names(spec: ast.Spec) -> set[str]:
    found: set[str] = {spec.model}
    found.update(p.name for p in spec.params)
    for node in spec.nodes:
        found.add(node.name)
        found.update(i.name for i in node.inputs)
        found.update(o.name for o in node.outputs)
        if node.kv_sequences is not None:
            found.update(node.kv_sequences.labels)
        found.update(c.label for c in node.cross_kv)
        found.update(c.name for c in node.combines)
        found.update(s.name for s in node.submodels)
    found.update(w.name for w in spec.walks)
    found.update(p.name for p in spec.partitions)
    for walk in spec.walks:
        for section in _sections(walk.body):
            if isinstance(section, ast.Loop) and section.name is not None:
                found.add(section.name)
    return found


def _sections(body):
    for section in body:
        yield section
        if not isinstance(section, ast.Call):
            yield from _sections(section.body)


def reversed_mapping(names: set[str]) -> dict[str, str]:
    """old -> new, the new names in the reverse sort order of the old ones."""
    ordered = sorted(names)
    return {name: f"r{len(ordered) - index:03d}x" for index, name in enumerate(ordered)}


def rename_spec(spec: ast.Spec) -> tuple[ast.Spec, dict[str, str]]:
    mapping = reversed_mapping(_names(spec))
    return _renamed(spec, mapping), mapping


def _renamed(tree: ast.AstNode, mapping: dict[str, str]) -> ast.AstNode:
    def name(value: str) -> str:
        return mapping.get(value, value)

    def names(values: list[str]) -> list[str]:
        return [name(v) for v in values]

    update: dict[str, Any] = {}
    for field in type(tree).model_fields:
        value = getattr(tree, field)
        if isinstance(value, ast.AstNode):
            update[field] = _renamed(value, mapping)
        elif isinstance(value, list) and value and isinstance(value[0], ast.AstNode):
            update[field] = [_renamed(v, mapping) for v in value]
    renamed_fields = _RENAMED.get(type(tree), ())
    for field in renamed_fields:
        value = getattr(tree, field)
        if isinstance(tree, ast.Edge) and field == "dest" and value in RESERVED_DESTS:
            continue
        if isinstance(value, list):
            update[field] = names(value)
        elif isinstance(value, str):
            update[field] = name(value)
    return tree.model_copy(update=update)


# Fields that hold an author's name, per AST class (argument names and values are not names).
_RENAMED: dict[type, tuple[str, ...]] = {
    ast.Spec: ("model",),
    ast.Param: ("name",),
    ast.NodeDecl: ("name",),
    ast.InputDecl: ("name",),
    ast.OutputDecl: ("name",),
    ast.KvSequences: ("labels",),
    ast.GuidanceDecl: ("label",),
    ast.CrossKv: ("label", "source"),
    ast.KvAccess: ("walk", "reads", "writes"),
    ast.Bidirectional: ("walks",),
    ast.CapDecl: ("walk",),
    ast.CaptureDecl: ("walk", "labels"),
    ast.CaptureReplay: ("walk", "source"),
    ast.CombineDecl: ("name", "walks"),
    ast.RowsLimit: ("walk",),
    ast.Edge: ("name", "dest"),
    ast.Call: ("node", "inputs"),
    ast.Loop: ("name", "max_iters", "count", "outputs", "accumulate"),
    ast.BatchingDecl: ("walk",),
    ast.SubModelDecl: ("name", "samples", "walks"),
    ast.Walk: ("name",),
    ast.StreamSource: ("partition", "edge"),
    ast.Stage: ("walks",),
    ast.Partition: ("name",),
    ast.Repeat: ("value", "max_rounds"),
}

# Deployment keys whose values are node or walk names (`NODE.WALK` in speculation_mixes_walks), and
# the key whose mapping keys are node names (kv_pool.nodes), or whose list holds them (kv_cache.nodes).
_NAME_VALUES = {"model", "node_names", "graph_walks"}
_DOTTED_VALUES = {"speculation_mixes_walks"}
_NAME_KEYS = {"nodes"}


def rename_deployment(data: Any, mapping: dict[str, str], key: str = "") -> Any:
    """The deployment's parsed YAML with node, walk and model names renamed by its structure."""
    if isinstance(data, dict):
        return {(mapping.get(k, k) if key in _NAME_KEYS else k): rename_deployment(v, mapping, k)
                for k, v in data.items()}
    if isinstance(data, list):
        return [rename_deployment(v, mapping, key) for v in data]
    if isinstance(data, str) and (key in _NAME_VALUES or key in _NAME_KEYS):  # kv_cache.nodes: a list
        return mapping.get(data, data)
    if isinstance(data, str) and key in _DOTTED_VALUES:
        return ".".join(mapping.get(part, part) for part in data.split("."))
    return data
