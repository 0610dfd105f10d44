"""`mstarc schema`: the deployment file's JSON Schema agrees with the loader.

Every config in configs/ validates against the schema, and for a set of edits to each (an unknown
key, a wrong type, a bound broken, a required key removed, and edits the loader accepts) the
schema accepts exactly what `parse_deployment` accepts.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from mstar.cli.mstarc import main
from mstar.compiler.deployment import parse_deployment
from mstar.lang.diagnostics import Diagnostics

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("schema") / "deployment.schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_printed_schema_is_a_valid_json_schema(capsys, schema):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == schema
    jsonschema.Draft202012Validator.check_schema(printed)
    assert printed["$schema"].endswith("2020-12/schema") and printed["additionalProperties"] is False
    assert {"model", "max_seq_len", "node_groups"} <= set(printed["required"])


def _edits(data: dict) -> list[tuple[str, dict]]:
    def edited(change) -> dict:
        copied = copy.deepcopy(data)
        change(copied)
        return copied

    return [
        ("unknown top-level key", edited(lambda d: d.update(no_such_key=1))),
        ("unknown key in a node group", edited(lambda d: d["node_groups"][0].update(ranks_typo=[0]))),
        ("tp_size 0", edited(lambda d: d["node_groups"][0].update(tp_size=0))),
        ("max_seq_len as text", edited(lambda d: d.update(max_seq_len="long"))),
        ("no node_groups", edited(lambda d: d.pop("node_groups"))),
        ("empty node_names", edited(lambda d: d["node_groups"][0].update(node_names=[]))),
        ("negative rank", edited(lambda d: d["node_groups"][0].update(ranks=[-1]))),
        ("bad replica policy", edited(lambda d: d.update(replica_policy="random"))),
        ("kv_pool page size", edited(lambda d: d.update(kv_pool={"page_size": 16, "nodes": {"X": {"num_pages": 4}}}))),
        ("budget", edited(lambda d: d.update(capture_memory_budget_mb=512.5))),
        ("speculation list", edited(lambda d: d.update(speculation_mixes_walks=["LLM"]))),
        ("sp_size 2", edited(lambda d: d["node_groups"][0].update(sp_size=2))),
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_schema_accepts_what_the_loader_accepts(config, schema):
    validator = jsonschema.Draft202012Validator(schema)
    data = yaml.safe_load(config.read_text())
    assert validator.is_valid(data), [e.message for e in validator.iter_errors(data)]
    for what, edited in _edits(data):
        diags = Diagnostics()
        is_loaded = parse_deployment(yaml.safe_dump(edited), "edited.yaml", diags) is not None
        assert validator.is_valid(edited) == is_loaded, (what, diags.render())
