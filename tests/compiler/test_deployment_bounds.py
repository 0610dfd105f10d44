"""Deployment values mstarc once accepted and the runtime then crashed on or refused (an audit of
configs/*.yaml edits): each is now a located diagnostic at compile time.

Every case edits a copy of a shipped config (and, where said, its spec), compiles it with the
driver and asserts the code and the words of the error; the unedited copies compile.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import pytest

from mstar.compiler.driver import compile_spec
from mstar.compiler.memory_bounds import MAX_CONCURRENT_REQUESTS
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import load_plan

ROOT = Path(__file__).resolve().parents[2]
HUGE = 4611686018427387904  # 2**62: fits the YAML's int64, past every count the runtime builds


def _compile(tmp_path: Path, config: str, extra: str = "", spec: Optional[str] = None,
             edit=None, spec_edit=None) -> tuple[Optional[object], Diagnostics]:
    """Compile specs/SPEC.mw (default: the config's model) against configs/CONFIG.yaml with `extra`
    appended and `edit(text)` / `spec_edit(text)` applied, in a copy of the repository layout."""
    for folder in ("specs", "configs"):
        (tmp_path / folder).mkdir(exist_ok=True)
    text = (ROOT / "configs" / f"{config}.yaml").read_text()
    model = spec or re.search(r'^model: "?(\w+)"?', text, re.MULTILINE).group(1)
    spec_text = (ROOT / "specs" / f"{model}.mw").read_text()
    spec_path = tmp_path / "specs" / f"{model}.mw"
    spec_path.write_text(spec_edit(spec_text) if spec_edit else spec_text)
    config_path = tmp_path / "configs" / f"{config}.yaml"
    config_path.write_text((edit(text) if edit else text) + extra)
    diags = Diagnostics()
    return compile_spec(spec_path, config_path, diags), diags


def _errors(diags: Diagnostics) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in diags.items if d.severity == "error"]


def _refused(tmp_path: Path, code: str, words: str, config: str, extra: str = "", **edits) -> None:
    result, diags = _compile(tmp_path, config, extra, **edits)
    assert result is None, f"compiled, expected {code}"
    errors = _errors(diags)
    assert any(c == code and words in m for c, m in errors), diags.render()
    assert "Traceback" not in diags.render()


@pytest.mark.parametrize("config", ["llama", "qwen3_5", "orpheus", "llama_chunked"])
def test_the_configs_edited_below_compile_unedited(tmp_path, config):
    result, diags = _compile(tmp_path, config)
    assert result is not None and not _errors(diags), diags.render()


# ---------------------------------------------------------------- 1. host pool, recurrent slots


def test_kv_cache_cpu_offload_pages_is_bounded_as_the_per_node_key(tmp_path):
    _refused(tmp_path, "MW304", "kv_cache.cpu_offload_pages: input should be less than or equal to 2147483647",
             "llama", f"kv_cache: {{cpu_offload_pages: {HUGE}}}\n")


@pytest.mark.parametrize("extra, edit", [
    ("kv_cache: {cpu_offload_pages: 2147483647}\n", None),
    ("", lambda t: t.replace("kv_pool:\n", "kv_pool:\n  nodes: {LLM: {cpu_offload_pages: 2147483647}}\n")),
])
def test_a_host_pool_past_what_the_runtime_can_allocate(tmp_path, extra, edit):
    """The documented page bound lets through 2**31 - 1 host pages: 1,024 TiB of Llama-1B KV."""
    _refused(tmp_path, "MW323", "KV offload host pool of LLM: cpu_offload_pages 2147483647 pages x 16 tokens",
             "llama", extra, edit=edit)


def test_recurrent_state_slots_are_bounded(tmp_path):
    _refused(tmp_path, "MW304", f"recurrent_state_slots: input should be less than or equal to "
             f"{MAX_CONCURRENT_REQUESTS}", "qwen3_5", edit=lambda t: t.replace("recurrent_state_slots: 96",
                                                                                f"recurrent_state_slots: {HUGE}"))


def test_recurrent_state_past_what_the_runtime_can_allocate(tmp_path):
    # 18 layers x 16 heads x 128 x 512 fp32 = 75.5 MiB a slot; 65,536 slots are 4.7 TiB
    _refused(tmp_path, "MW323", "recurrent state of LLM: 65536 slots", "qwen3_5",
             edit=lambda t: t.replace("recurrent_state_slots: 96", "recurrent_state_slots: 65536"),
             spec_edit=lambda t: t.replace("value_dim=128", "value_dim=512"))


def test_fewer_recurrent_slots_than_admitted_requests(tmp_path):
    """The runtime refused such a plan at start-up (SlotPoolError)."""
    _refused(tmp_path, "MW325", "recurrent_state_slots 96 cannot hold max_concurrent_requests=128", "qwen3_5",
             "max_concurrent_requests: 128\n")


def test_max_concurrent_requests_is_bounded(tmp_path):
    """Slots default to it (a 2**62-entry free list at start-up) and a walk without a cap or a
    capture is capped by it (cosmos3's `eager_above` prefill capture: a 2**62-entry batch_pad; the
    compile never ended)."""
    _refused(tmp_path, "MW304", f"max_concurrent_requests: input should be less than or equal to "
             f"{MAX_CONCURRENT_REQUESTS}", "cosmos3", f"max_concurrent_requests: {HUGE}\n")


def test_the_largest_max_concurrent_requests_gives_a_plan_that_loads(tmp_path):
    """At the bound, cosmos3_nano_tp2's plan (two workers of uncapped eager_above families, whose
    batch_pad tables it sizes) is far below the 16 MiB a plan may have; at 2**20 it was 18.9 MB."""
    result, diags = _compile(tmp_path, "cosmos3_nano_tp2", f"max_concurrent_requests: {MAX_CONCURRENT_REQUESTS}\n")
    assert result is not None, diags.render()
    assert len(result.plan_text.encode()) < 4 * 2**20
    result.plan_path.parent.mkdir(parents=True)
    result.plan_path.write_text(result.plan_text)
    result.glue_path.write_text(result.glue_text)
    assert load_plan(result.plan_path).deployment.max_concurrent_requests == MAX_CONCURRENT_REQUESTS


# ---------------------------------------------------------------- 2. ranks


def test_a_rank_past_the_bound(tmp_path):
    _refused(tmp_path, "MW304", "node_groups[0].ranks[0]: input should be less than or equal to 1023", "llama",
             edit=lambda t: t.replace("ranks: [0]", f"ranks: [{HUGE}]"))


def test_a_one_gpu_deployment_on_rank_15(tmp_path):
    """The runtime started 16 processes, 15 with nothing to do."""
    _refused(tmp_path, "MW324", "rank 15 leaves ranks 0 to 14 unused: the deployment's 1 rank must be rank 0",
             "llama", edit=lambda t: t.replace("ranks: [0]", "ranks: [15]"))


def test_a_skipped_rank(tmp_path):
    _refused(tmp_path, "MW324", "rank 2 leaves rank 1 unused: the deployment's 2 ranks must be ranks 0 and 1",
             "orpheus", edit=lambda t: t.replace("ranks: [1]", "ranks: [2]"))


# ---------------------------------------------------------------- 3. capture memory in bytes


def test_capture_budget_whose_bytes_pass_int64(tmp_path):
    """9e12 MB is 9.4e18 bytes in the plan, past int64: the runtime called the plan truncated."""
    _refused(tmp_path, "MW304", "capture_memory_budget_mb: input should be less than or equal to 2097152",
             "llama", edit=lambda t: t.replace("capture_memory_budget_mb: 4096",
                                               "capture_memory_budget_mb: 9000000000000"))


def test_capture_estimate_past_int64_without_a_budget(tmp_path):
    """A 2**31-wide node with 4,096 captured batch sizes: its family's estimate was 9.25e18 bytes in
    the plan (past int64) when no budget bounded it."""
    batches = ", ".join(str(b) for b in range(1, 4097))
    spec = (ROOT / "specs" / "llama.mw").read_text()
    header = re.search(r"node LLM kv\(.*?\) tp \{", spec, re.DOTALL).group(0)
    wide = ("node LLM kv(layers=1, kv_heads=1, qo_heads=1, head_dim=2, hidden=2147483647, intermediate=1, "
            "vocab=2) tp {")
    body = re.search(r"    in text_inputs.*?    kv_sequences main\n", spec, re.DOTALL).group(0)

    def narrow(text: str) -> str:
        start = text.index(header)
        end = text.index("\n}\n", start)
        return (text[:start] + wide + "\n" + body + "    cap decode 4096\n"
                f"    capture decode batched batch=[{batches}] tokens_per_row=256\n" + text[end + 1:])

    _refused(tmp_path, "MW408", "capture memory estimate on rank 0 is 8,415,232 TiB, more than the runtime can "
             "allocate (2 TiB", "llama", spec_edit=narrow,
             edit=lambda t: t.replace("capture_memory_budget_mb: 4096\n", "").replace("8192", "1024"))


# ---------------------------------------------------------------- 4. kv_cache numbers


@pytest.mark.parametrize("key, value, words", [
    ("max_seq_len", -1, "greater than or equal to 1"),
    ("max_seq_len", 0, "greater than or equal to 1"),
    ("num_layers", -5, "greater than or equal to 1"),
    ("num_kv_heads", 0, "greater than or equal to 1"),
    ("num_qo_heads", -1, "greater than or equal to 1"),
    ("head_dim", -1, "greater than or equal to 1"),
    ("head_dim", HUGE, "less than or equal to 2147483647"),
])
def test_kv_cache_numbers_are_counts(tmp_path, key, value, words):
    _refused(tmp_path, "MW304", f"kv_cache.{key}: input should be {words}", "llama", f"kv_cache: {{{key}: {value}}}\n")


def test_kv_cache_max_seq_len_must_fit_the_pool(tmp_path):
    """The pool's max_seq_len sizes the runtime's per-request tables (a 2**62-long one overflowed)."""
    _refused(tmp_path, "MW322", "less than one kv_cache.max_seq_len 4611686018427387904 request", "llama",
             f"kv_cache: {{max_seq_len: {HUGE}}}\n")
