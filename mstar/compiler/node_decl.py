"""A node declaration's values as the plan holds them: its arguments (`NodePlan.dims`) and its
recurrent state (`NodePlan.recurrent`). Lowering writes them into the plan; the deployment check
reads a kv node's dims from the same values before there is a plan (MW326), so both see one node.

In:  an `ast.NodeDecl` (its args already checked by check_args), a `Deployment` (the state's slots).
Out: `arg_values(args) -> dict`, `recurrent_state(node, deployment) -> RecurrentState | None`.
"""
from __future__ import annotations

from mstar.compiler.deployment import Deployment
from mstar.lang import ast
from mstar.plan.schema import RecurrentState


def arg_values(args: list[ast.Arg]) -> dict:
    return {a.name: (list(a.value) if isinstance(a.value, list) else a.value) for a in args}


def recurrent_state(node: ast.NodeDecl, deployment: Deployment) -> RecurrentState | None:
    for state in node.states:
        if state.kind != "recurrent":
            continue
        args = arg_values(state.args)
        num_requests = deployment.recurrent_slots()
        return RecurrentState(
            num_layers=int(args.get("layers", 0)),
            num_heads=int(args.get("heads", 0)),
            key_dim=int(args.get("key_dim", 0)),
            value_dim=int(args.get("value_dim", 0)),
            num_slots=num_requests + 1,
        )
    return None
