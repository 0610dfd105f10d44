"""Every spec passes the checks against every config naming its model."""
from pathlib import Path

import pytest
import yaml

from checks_golden import run_checks
from mstar.lang.diagnostics import Diagnostics

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _model(config: Path) -> str:
    return yaml.safe_load(config.read_text(encoding="utf-8"))["model"]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_spec_passes_checks_against_config(config):
    spec = ROOT / "specs" / f"{_model(config)}.mw"
    if not spec.exists():
        pytest.skip(f"{spec.name} is not written yet")
    diags = Diagnostics()
    run_checks(str(spec), str(config), diags)
    assert diags.render() == ""


def test_every_spec_has_its_default_config():
    for spec in (ROOT / "specs").glob("*.mw"):
        assert (ROOT / "configs" / f"{spec.stem}.yaml").exists(), spec.name
