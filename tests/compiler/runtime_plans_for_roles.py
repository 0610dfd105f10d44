"""Every checked-in plan of generated/, loaded without re-hashing its inputs."""
from pathlib import Path

from mstar.plan.io import load_plan

ROOT = Path(__file__).resolve().parents[2]


def every_generated_plan():
    return [load_plan(path, verify=False) for path in sorted((ROOT / "generated").glob("*.plan"))]
