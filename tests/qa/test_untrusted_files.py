"""What mstar loads and runs from files someone else may have written (docs/plan.md, "What mstar
trusts"): the glue that runs is exactly the glue whose sha256 the plan records (not a bytecode file
planted beside it, not a file swapped after the check, not a source Triton re-reads from disk), and
a pickled SNAC checkpoint is refused where torch.load could run code from it."""
from __future__ import annotations

import importlib.util
import inspect
import linecache
import marshal
import shutil
from pathlib import Path

import pytest
import torch

from mstar.files import read_bytes_bounded
from mstar.plan.io import load_plan
from mstar.runtime.engine import glue_loader, snac_checkpoint
from mstar.runtime.engine.checkpoint_config import WeightsError
from mstar.runtime.engine.torch_engine import EngineError, plan_glue

ROOT = Path(__file__).resolve().parents[2]


def _llama(tmp_path: Path) -> tuple[Path, Path]:
    """generated/llama.plan with its glue, spec and deployment, copied where the plan finds them."""
    for folder, name in (("generated", "llama.plan"), ("generated", "llama_glue.py"), ("specs", "llama.mw"),
                         ("configs", "llama.yaml")):
        (tmp_path / folder).mkdir(exist_ok=True)
        shutil.copy(ROOT / folder / name, tmp_path / folder / name)
    return tmp_path / "generated" / "llama.plan", tmp_path / "generated" / "llama_glue.py"


def _marker_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()\nGLUE_BY_WORKER = {{}}\n"


def test_a_bytecode_file_planted_beside_the_glue_is_not_run(tmp_path):
    """Importing by path ran __pycache__/NAME.cpython-XY.pyc, whose header records only the
    source's mtime and size, although the .py's hash matched the plan."""
    plan_path, glue = _llama(tmp_path)
    marker = tmp_path / "ran"
    source = glue.stat()
    pyc = Path(importlib.util.cache_from_source(str(glue)))
    pyc.parent.mkdir()
    header = (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little") + int(source.st_mtime).to_bytes(4, "little")
              + (source.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
    pyc.write_bytes(header + marshal.dumps(compile(_marker_code(marker), str(glue), "exec")))
    module = plan_glue(load_plan(plan_path), str(plan_path), "cuda")
    assert not marker.exists()
    assert module is not None and "LLM:mixed" in module.GLUE_BY_WORKER[0]


def test_a_glue_file_swapped_after_the_plan_was_checked_is_not_run(tmp_path):
    """load_plan checks the glue's hash; the engine loads it later (after the weights): the file
    read then was imported unchecked."""
    plan_path, glue = _llama(tmp_path)
    plan = load_plan(plan_path)
    marker = tmp_path / "ran"
    glue.write_text(glue.read_text() + _marker_code(marker))
    with pytest.raises(EngineError, match="is not the one its plan was compiled with"):
        plan_glue(plan, str(plan_path), "cuda")
    assert not marker.exists()


def test_triton_compiles_the_checked_source_not_the_file_on_disk(tmp_path, monkeypatch):
    """Triton takes a kernel's source from inspect.getsourcelines, which read the file again by its
    name: a file swapped between the check and the kernels' definition changed what they compile."""
    plan_path, glue = _llama(tmp_path)
    checked = glue.read_text()

    def read_then_swap(path, **kwargs):
        data = read_bytes_bounded(path, **kwargs)
        glue.write_text(checked.replace("    rows = tl.arange(", "    PLANTED = 1\n    rows = tl.arange("))
        return data

    monkeypatch.setattr(glue_loader, "read_bytes_bounded", read_then_swap)
    module = plan_glue(load_plan(plan_path), str(plan_path), "cuda")
    assert "PLANTED" in glue.read_text()
    kernel = module._pack_step_llm_mixed_kernel.jitted
    assert "rows = tl.arange(" in kernel.src and "PLANTED" not in kernel.src
    linecache.clearcache()  # the checked lines gone: no source at all, never the disk's
    with pytest.raises(OSError):
        inspect.getsourcelines(kernel.fn)


def _snac_dir(tmp_path: Path, with_safetensors: bool) -> Path:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    if with_safetensors:
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_pickled_snac_checkpoint_is_refused_where_torch_load_can_run_code(tmp_path, monkeypatch):
    """torch.load(weights_only=True) before torch 2.6 could be made to run code (CVE-2025-32434),
    and pyproject allows torch 2.4."""
    calls = []
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: calls.append(args) or {"w": torch.zeros(2)})
    with pytest.raises(WeightsError, match="pytorch_model.bin: torch 2.5.1.* upgrade torch .* model.safetensors"):
        snac_checkpoint.read_snac_state(str(_snac_dir(tmp_path, with_safetensors=False)))
    assert calls == []
    monkeypatch.setattr(torch, "__version__", "2.10.0")  # not read as a string: "2.10" < "2.6"
    assert snac_checkpoint.read_snac_state(str(tmp_path))["w"].tolist() == [0.0, 0.0]


def test_a_snac_checkpoint_with_both_files_is_read_from_safetensors(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("the pickle was read"))
    state = snac_checkpoint.read_snac_state(str(_snac_dir(tmp_path, with_safetensors=True)))
    assert state["w"].tolist() == [1.0, 1.0]
