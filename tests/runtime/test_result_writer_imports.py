"""`mstar run --out` loads the media encoders (and torch with them) before the run when the plan
emits audio or images, so the first finished request's write does not import them inside a step's
post-process (sim runs of qwen3_tts: a post-process mean of 1.7-12 ms a step before, 49-67 us after);
a text plan's sim run still never imports torch. `mstar serve` calls the same
`endpoints.load_media_encoders` before serving."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import argparse, sys
from mstar.cli.mstar import _result_writer
from mstar.plan.io import load_plan
writer = _result_writer(argparse.Namespace(out=sys.argv[2]), load_plan(sys.argv[1]), None)
print("media" if "mstar.runtime.serve.media" in sys.modules else "-", "torch" if "torch" in sys.modules else "-")
"""


@pytest.mark.parametrize("plan, expected", [("qwen3_tts", "media torch"), ("bagel", "media torch"),
                                            ("llama", "- -")])
def test_the_writer_loads_the_media_encoders_only_for_plans_that_emit_media(tmp_path, plan, expected):
    done = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "generated" / f"{plan}.plan"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
