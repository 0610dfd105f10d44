"""The language's role words and the plan's role enums are the same lists (the plan package may not
import the language, so each keeps its own copy), and every spec's roles reach its plans."""
from typing import get_args

from mstar.lang import ast
from mstar.plan import schema
from runtime_plans_for_roles import every_generated_plan


def test_role_words_match_the_plan_enums():
    assert ast.INPUT_ROLES == get_args(schema.InputRole)
    assert ast.OUTPUT_ROLES == get_args(schema.OutputRole)
    assert ast.MODALITIES == get_args(schema.Modality)
    assert ast.CLIENT_MODALITIES == get_args(schema.ClientModality)
    assert ("decoder",) + ast.MODEL_KINDS == get_args(schema.ModelKind)


def test_generated_plans_carry_roles_for_every_input_and_edge():
    for plan in every_generated_plan():
        for node in plan.nodes:
            assert {r.name for r in node.input_roles} == set(node.inputs) | set(node.stream_inputs)
            assert (node.engine == "kv") == (node.model_kind == "decoder")
        prompted = [r for n in plan.nodes for r in n.input_roles if r.prompt == "text"]
        assert prompted, plan.header.deployment
