"""load_glue: a generated file by path, checked against its plan's hash, with readable errors
(tests/qa/test_untrusted_files.py: what runs is what was checked)."""
import pytest
from glue_modules import checked_in_glue, generated_glue_files
from glue_plans import tiny_plan

from mstar.compiler.glue import render_glue
from mstar.plan.io import load_plan, sha256_file
from mstar.runtime.engine.glue_loader import GlueLoadError, load_glue


def test_loads_a_rendered_module(tmp_path):
    path = tmp_path / "tiny_glue.py"
    path.write_text(render_glue(tiny_plan(), "tiny", "tiny"))
    module = load_glue(path, sha256_file(path))
    key_glue = module.GLUE_BY_WORKER[0]["LLM:mixed"]
    assert key_glue.constants.page_size == 4
    assert load_glue(path, sha256_file(path)) is not module  # a fresh module each load


def test_missing_file(tmp_path):
    with pytest.raises(GlueLoadError, match="no such file; run `mstarc regen`"):
        load_glue(tmp_path / "nope_glue.py", "0" * 64)


def test_a_file_of_another_hash_is_not_run(tmp_path):
    path = tmp_path / "tiny_glue.py"
    path.write_text("raise SystemExit('ran')\n")
    with pytest.raises(GlueLoadError, match="not the one its plan was compiled with .*mstarc regen"):
        load_glue(path, "0" * 64)


def test_broken_file(tmp_path):
    path = tmp_path / "bad_glue.py"
    path.write_text("GLUE_BY_WORKER = {\n")
    with pytest.raises(GlueLoadError, match="failed to import .*SyntaxError"):
        load_glue(path, sha256_file(path))


def test_file_without_tables(tmp_path):
    path = tmp_path / "empty_glue.py"
    path.write_text("X = 1\n")
    with pytest.raises(GlueLoadError, match="no GLUE_BY_WORKER"):
        load_glue(path, sha256_file(path))


@pytest.mark.parametrize("glue_path", generated_glue_files(), ids=lambda p: p.name)
def test_generated_glue_covers_the_plans_kv_keys(glue_path):
    """Every checked-in glue file loads, and has glue for exactly its plan's kv-node keys."""
    plan = load_plan(glue_path.with_name(glue_path.name.removesuffix("_glue.py") + ".plan"), verify=False)
    kv_nodes = {node.name for node in plan.nodes if node.engine == "kv"}
    expected = {worker.rank: sorted(key.name for key in worker.keys if key.node in kv_nodes)
                for worker in plan.workers}
    module = checked_in_glue(glue_path)
    got = {rank: sorted(module.GLUE_BY_WORKER.get(rank, {})) for rank in expected}
    assert got == expected
