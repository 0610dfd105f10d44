"""Fuzz every file reader (issue 15): random bytes, random YAML and JSON structures, and real files
with one value replaced by a random structure. Compiler side: spec, deployment, plan; runtime
side: the prompts file of `mstar run`.

Each example writes one file and runs the reader on it in-process under bounded_call's limits;
it must exit 0, 1 or 2, with a message when not 0, no traceback or internal error, in under 2 s
and 500 MB. The `ci` profile (default) runs a dozen examples per reader and input kind;
`HYPOTHESIS_PROFILE=long` runs the profile's count.

Adding a reader: put `name -> function(path, capsys) -> Outcome` in READERS. The input kinds
below are sent to every reader.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bounded_call import Outcome, call_bounded
from mstar.cli import mstar as mstar_cli
from mstar.cli import mstarc as mstarc_cli
from mstar.cli.mstarc import main as mstarc_main
from mstar.plan.io import content_hash, dump_plan
from mstar.plan.schema import Plan

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "orpheus.mw"
CONFIG = ROOT / "configs" / "orpheus.yaml"

NUM_EXAMPLES = 12 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else settings.default.max_examples
FUZZ = settings(max_examples=NUM_EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _spec_reader(path: Path, capsys) -> Outcome:
    return call_bounded(mstarc_cli.main, ["check", path, "--config", CONFIG], capsys)


def _deployment_reader(path: Path, capsys) -> Outcome:
    return call_bounded(mstarc_cli.main, ["check", SPEC, "--config", path], capsys)


def _plan_reader(path: Path, capsys) -> Outcome:
    return call_bounded(mstarc_cli.main, ["explain", path], capsys)


def _fmt_reader(path: Path, capsys) -> Outcome:
    return call_bounded(mstarc_cli.main, ["fmt", path], capsys)


_RUN = ["run", "--plan", ROOT / "generated" / "orpheus.plan", "--engine", "sim", "--no-progress"]
_is_run_warm = []


def _prompts_reader(path: Path, capsys) -> Outcome:
    """`mstar run --prompts path` on the simulated engine: a valid file runs (exit 0)."""
    if not _is_run_warm:  # the run's lazy imports and first plan load, outside the bound
        with tempfile.TemporaryDirectory() as folder:
            warm = Path(folder) / "p.jsonl"
            warm.write_text('{"id": "w", "prompt_tokens": [1], "max_tokens": 1}\n')
            assert mstar_cli.main([str(a) for a in _RUN + ["--prompts", warm]]) == 0
        _is_run_warm.append(True)
    return call_bounded(mstar_cli.main, _RUN + ["--prompts", path], capsys)


READERS: dict[str, Callable[[Path, object], Outcome]] = {
    "spec": _spec_reader,
    "spec (fmt)": _fmt_reader,
    "deployment": _deployment_reader,
    "plan": _plan_reader,
    "prompts": _prompts_reader,
}

# ---------------------------------------------------------------- inputs

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
structures = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=30,
)


def _as_yaml(value) -> str:
    return yaml.safe_dump(value, allow_unicode=True)


def _as_json(value) -> str:
    return json.dumps(value)


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="mstar-fuzz-") as folder:
        root = Path(folder)
        plan = root / "real" / "orpheus.plan"
        assert mstarc_main(["compile", str(SPEC), "--config", str(CONFIG), "-o", str(plan)]) == 0
        yield root


def _write(workdir: Path, name: str, data: bytes) -> Path:
    path = workdir / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("reader", sorted(READERS))
@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes(workdir, capsys, reader, data):
    READERS[reader](_write(workdir, "input", data), capsys).assert_clean()


@pytest.mark.parametrize("reader", sorted(READERS))
@FUZZ
@given(value=structures, as_text=st.sampled_from([_as_yaml, _as_json]))
def test_random_structures(workdir, capsys, reader, value, as_text):
    text = as_text(value)
    READERS[reader](_write(workdir, "input", text.encode("utf-8", "surrogatepass")), capsys).assert_clean()


def _paths(value, prefix=()):
    """Every (path, value) inside a JSON-like value."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _replaced(data, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(data) if isinstance(data, dict) else list(data)
    copy[head] = _replaced(data[head], rest, new)
    return copy


@FUZZ
@given(pick=st.integers(min_value=0), value=structures)
def test_real_deployment_with_one_value_replaced(workdir, capsys, pick, value):
    data = yaml.safe_load(CONFIG.read_text())
    paths = [p for p, _ in _paths(data) if p]
    edited = _replaced(data, paths[pick % len(paths)], value)
    path = _write(workdir, "edited.yaml", _as_yaml(edited).encode("utf-8", "surrogatepass"))
    _deployment_reader(path, capsys).assert_clean()


@FUZZ
@given(pick=st.integers(min_value=0), value=structures)
def test_real_plan_with_one_value_replaced_and_rehashed(workdir, capsys, pick, value):
    """A hand edit that keeps the content hash right: schema and reference checks must catch it."""
    real = workdir / "real" / "orpheus.plan"
    data = json.loads(real.read_text())
    paths = [p for p, _ in _paths(data) if p and p != ("header", "content_sha256")]
    edited = _replaced(data, paths[pick % len(paths)], value)
    try:
        plan = Plan.model_validate(edited)
        header = plan.header.model_copy(update={"content_sha256": content_hash(plan)})
        text = dump_plan(plan.model_copy(update={"header": header}))
    except (ValueError, TypeError):  # not a plan at all: the file holds the edited JSON as is
        text = json.dumps(edited)
    path = _write(workdir / "real", "edited.plan", text.encode("utf-8", "surrogatepass"))
    _plan_reader(path, capsys).assert_clean()
