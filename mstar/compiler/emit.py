"""Pass 7, emit: the final plan (header completed) and the texts of the generated files.

In:  the lowered `Plan` (header with the spec and deployment hashes, glue hash empty) and the
     glue source rendered from it (the glue never depends on the header).
Out: `finish(plan, glue_text) -> Plan` with the glue's sha256 and the plan's content hash in its
     header; `plan_text(plan)` its canonical JSON; `write_outputs(...)` writes both files.
"""
from __future__ import annotations

from pathlib import Path

from mstar.files import atomic_write_many, make_dirs
from mstar.plan.io import content_hash, dump_plan, sha256_bytes
from mstar.plan.schema import Plan


def finish(plan: Plan, glue_text: str) -> Plan:
    """The plan with `header.hashes.glue` and `header.content_sha256` filled in."""
    hashes = plan.header.hashes.model_copy(update={"glue": sha256_bytes(glue_text.encode("utf-8"))})
    header = plan.header.model_copy(update={"hashes": hashes, "content_sha256": ""})
    plan = plan.model_copy(update={"header": header})
    header = header.model_copy(update={"content_sha256": content_hash(plan)})
    return plan.model_copy(update={"header": header})


def plan_text(plan: Plan) -> str:
    return dump_plan(plan)


def write_outputs(plan_path: Path, plan_body: str, glue_path: Path, glue_text: str) -> None:
    """Write the plan and its glue, creating their directory: both or neither (temporaries,
    then renames, the glue first; see mstar.files.atomic_write_many), so a failure leaves the
    old plan and the glue it was compiled with. Bytes are written exactly (no newline
    translation) so a rewrite of an unchanged plan is byte-identical."""
    for path in (glue_path, plan_path):
        make_dirs(path.parent)
    atomic_write_many([(glue_path, glue_text.encode("utf-8")), (plan_path, plan_body.encode("utf-8"))])
