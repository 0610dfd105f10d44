"""A plan from another compiler version is refused on load (plan/io.py `_check_versions`); that
holds only if the version moves when what mstarc writes does. It stayed "0.1.0" from the first
commit while the plans' tables changed under it, so a plan written months before still loaded
(a plan checks its own spec's and deployment's hashes, not the compiler that lowered them).

The pin below ties COMPILER_VERSION to what mstarc writes for the repository's specs: a digest of
generated/'s plans (their headers left out, which carry the version) and glue. When the digest
moves (`mstarc regen` after a change to the compiler, a template, a spec or a config), this test
fails until COMPILER_VERSION is bumped, `mstarc regen` run again and the pin set to the new pair."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mstar.plan.schema import COMPILER_VERSION

GENERATED = Path(__file__).resolve().parents[2] / "generated"
PINNED_VERSION = "0.2.0"
PINNED_DIGEST = "e08a147ca954ebeb3b14007cda935526478f8ade2b74aebfd0ba646a25429025"


def written_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(GENERATED.glob("*.plan")):
        data = json.loads(path.read_text())
        del data["header"]
        digest.update(path.name.encode() + json.dumps(data, sort_keys=True).encode())
    for path in sorted(GENERATED.glob("*_glue.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def test_what_mstarc_writes_moves_with_its_version():
    digest = written_digest()
    if digest != PINNED_DIGEST:
        assert COMPILER_VERSION != PINNED_VERSION, (
            f"generated/ changed since COMPILER_VERSION {PINNED_VERSION} was pinned, and the version did not: plans "
            "written before would still load. Bump COMPILER_VERSION (mstar/plan/schema.py), run `mstarc regen`, and "
            f"pin PINNED_VERSION = {COMPILER_VERSION!r} (bumped) with PINNED_DIGEST = {digest!r} here")
        raise AssertionError(f"COMPILER_VERSION is {COMPILER_VERSION}: pin it here with PINNED_DIGEST = {digest!r}")
    assert COMPILER_VERSION == PINNED_VERSION, f"pin PINNED_VERSION = {COMPILER_VERSION!r} here"
