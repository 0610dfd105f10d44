"""Triton's FP fusion is stated by mstar before its kernels compile (engine/triton_defaults.py):
on, as every kernel was measured and tested, unless the environment chose."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

PROBE = ("import os\n"
         "import {module}\n"
         "print(os.environ.get('TRITON_DEFAULT_FP_FUSION'))\n")


def _fusion_after_import(module: str, preset: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if preset is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = preset
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", ["mstar.runtime.engine.glue_jit", "mstar.runtime.engine.gpu.kernels"])
def test_fusion_is_on_once_a_kernel_module_is_imported(module):
    assert _fusion_after_import(module, None) == "1"


def test_a_users_choice_is_kept():
    assert _fusion_after_import("mstar.runtime.engine.glue_jit", "0") == "0"

