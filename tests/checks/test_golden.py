"""Golden tests: one failing fixture per diagnostic code, compared with its exact rendering."""
from pathlib import Path

import pytest

from checks_golden import FIXTURES, render_fixture
from mstar.compiler import codes

NAMES = sorted(p.stem for p in FIXTURES.glob("MW*.expected"))


@pytest.fixture(autouse=True)
def _in_tests_checks(monkeypatch):
    # Fixture paths render relative to tests/checks.
    monkeypatch.chdir(Path(__file__).parent)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_renders_exactly(name):
    expected = (FIXTURES / f"{name}.expected").read_text(encoding="utf-8")
    assert render_fixture(name) == expected


def test_every_check_code_has_a_fixture():
    covered = {name.split("_")[0] for name in NAMES}
    assert set(codes.TITLES) - covered == set()


def test_base_spec_and_deployment_pass():
    from checks_golden import run_checks
    from mstar.lang.diagnostics import Diagnostics

    diags = Diagnostics()
    run_checks("fixtures/base.mw", "fixtures/base_ok.yaml", diags)
    assert diags.render() == ""
