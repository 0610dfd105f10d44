"""Bad input to `mstarc` and `mstar run` gives a clear message and exit 1 (2 for usage), never a
Python traceback or an "internal error".

Each case calls the command's `main()` in-process (no interpreter start per case, so the file
stays fast) and checks the exit status, a fragment of the message, and that neither a traceback
nor mstarc's internal-error fallback appears. Inputs are built in `tmp_path` from copies of the
repository's specs and configs; nothing under the repository is written.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_call import call_main

from mstar.cli import mstar as mstar_cli
from mstar.cli import mstarc as mstarc_cli

ROOT = Path(__file__).resolve().parents[2]


def _expect(main, argv, capsys, status: int, fragment: str) -> str:
    actual, text = call_main(main, argv, capsys)
    assert "Traceback" not in text, text
    assert "internal error" not in text, text
    assert actual == status, text
    assert fragment in text, text
    return text


def mstarc(argv, capsys, status, fragment):
    return _expect(mstarc_cli.main, argv, capsys, status, fragment)


def mstar(argv, capsys, status, fragment):
    return _expect(mstar_cli.main, argv, capsys, status, fragment)


@pytest.fixture
def work(tmp_path) -> Path:
    """A copy of specs/ and configs/ (so stale-plan edits touch nothing in the repository)."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


def _yaml(work: Path, name: str, text: str) -> Path:
    path = work / "configs" / f"{name}.yaml"
    path.write_text(text)
    return path


ORPHEUS_GROUPS = """
node_groups:
  - node_names: [LLM]
    ranks: [0]
  - node_names: [snac_decoder]
    ranks: [1]
"""


# ---------------------------------------------------------------- mstarc: specs and configs

def test_usage_errors_exit_2(capsys):
    mstarc([], capsys, 2, "required: COMMAND")
    mstarc(["frob"], capsys, 2, "invalid choice")
    mstarc(["graph", "specs/bagel.mw"], capsys, 2, "-o/--output")


def test_malformed_spec(work, capsys):
    bad = work / "specs" / "bad.mw"
    bad.write_text("model foo\nnode x {\n")
    for command in ("compile", "check", "graph"):
        extra = ["-o", work / "x.svg"] if command == "graph" else []
        mstarc([command, bad, *extra], capsys, 1, "error[MW002]")
    mstarc(["fmt", bad], capsys, 1, "error[MW002]")


def test_missing_spec(work, capsys):
    mstarc(["check", work / "nope.mw"], capsys, 1, "spec file not found")
    mstarc(["fmt", work / "nope.mw"], capsys, 1, "cannot read spec")


@pytest.mark.parametrize("text, fragment", [
    ("model: [unclosed\n", "not valid YAML"),
    ("", "the deployment file is empty"),
    ("- a\n- b\n", "must be a mapping"),
    ('model: "orpheus"\nmax_seq_len: 1024\nbogus_key: 3\n' + ORPHEUS_GROUPS, "unknown key 'bogus_key'"),
    ('model: "orpheus"\nmax_seq_len: "lots"\n' + ORPHEUS_GROUPS, "input should be a valid integer"),
    ('model: "orpheus"\nmax_seq_len: -5\n' + ORPHEUS_GROUPS, "greater than or equal to 1"),
    ('model: "orpheus"\n' + ORPHEUS_GROUPS, "missing required key 'max_seq_len'"),
    ('model: "orpheus"\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: 0\n',
     "input should be a valid list"),
    ('model: "orpheus"\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n'
     "    tensor_parallel_size: 2\n", "unknown key 'tensor_parallel_size'"),
])
def test_malformed_config(work, capsys, text, fragment):
    config = _yaml(work, "bad", text)
    mstarc(["check", work / "specs" / "orpheus.mw", "--config", config], capsys, 1, fragment)
    mstarc(["compile", work / "specs" / "orpheus.mw", "--config", config], capsys, 1, fragment)
    assert not (work / "generated").exists()


def test_missing_config(work, capsys):
    mstarc(["check", work / "specs" / "llama.mw", "--config", work / "nope.yaml"], capsys, 1,
           "cannot read deployment file")


def test_config_of_another_model(work, capsys):
    text = mstarc(["check", work / "specs" / "llama.mw", "--config", work / "configs" / "orpheus.yaml"],
                  capsys, 1, "error[MW319]")
    assert "deployment is for model 'orpheus' but the spec is model 'llama'" in text


@pytest.mark.parametrize("groups, fragment", [
    # ranks not a multiple of tp
    ("  - node_names: [LLM]\n    ranks: [0, 1, 2]\n    tp_size: 2\n"
     "  - node_names: [snac_decoder]\n    ranks: [0]\n", "error[MW315]"),
    # a node placed nowhere
    ("  - node_names: [LLM]\n    ranks: [0]\n", "error[MW310]"),
    # two lockstep nodes on one worker
    ("  - node_names: [LLM]\n    ranks: [0, 1]\n    tp_size: 2\n"
     "  - node_names: [snac_decoder]\n    ranks: [0, 1]\n    tp_size: 2\n", "error[MW317]"),
    # tp on a node not marked `tp`
    ("  - node_names: [LLM]\n    ranks: [0]\n"
     "  - node_names: [snac_decoder]\n    ranks: [1, 2]\n    tp_size: 2\n", "error[MW316]"),
    ("  - node_names: [LLM]\n    ranks: [0]\n    tp_size: 0\n"
     "  - node_names: [snac_decoder]\n    ranks: [-1]\n", "greater than or equal to"),
])
def test_impossible_deployment(work, capsys, groups, fragment):
    config = _yaml(work, "bad", f'model: "orpheus"\nmax_seq_len: 1024\nnode_groups:\n{groups}')
    mstarc(["check", work / "specs" / "orpheus.mw", "--config", config], capsys, 1, fragment)


def test_capture_over_memory_budget(work, capsys):
    config = _yaml(work, "bad", 'model: "orpheus"\nmax_seq_len: 1024\ncapture_memory_budget_mb: 1\n'
                   + ORPHEUS_GROUPS)
    text = mstarc(["check", work / "specs" / "orpheus.mw", "--config", config], capsys, 1, "error[MW408]")
    assert "over capture_memory_budget_mb 1" in text


def test_unwritable_outputs(work, capsys):
    blocker = work / "a_file"
    blocker.write_text("")
    spec = work / "specs" / "bagel.mw"
    mstarc(["graph", spec, "-o", blocker / "b.svg"], capsys, 1, "exists and is not a directory")
    directory = work / "picture.svg"  # a directory where the picture would go
    directory.mkdir()
    mstarc(["graph", spec, "-o", directory], capsys, 1, f"cannot write {directory}")
    mstarc(["graph", spec, "-o", work], capsys, 2, "graph writes SVG only")
    mstarc(["compile", work / "specs" / "llama.mw", "-o", blocker / "x.plan"], capsys, 1,
           "exists and is not a directory")


# ---------------------------------------------------------------- plans

@pytest.fixture
def plan(work, capsys) -> Path:
    """A freshly compiled llama plan in the work copy."""
    mstarc(["compile", work / "specs" / "llama.mw"], capsys, 0, "wrote")
    return work / "generated" / "llama.plan"


def _refused(plan_path, capsys, fragment):
    mstarc(["explain", plan_path], capsys, 1, fragment)
    mstar(["run", "--plan", plan_path, "--engine", "sim", "--no-progress"], capsys, 1, fragment)


def test_stale_plan(work, plan, capsys):
    with open(work / "specs" / "llama.mw", "a") as f:
        f.write("# edited after compiling\n")
    _refused(plan, capsys, "is stale: its spec file")
    # the recompile command names the spec by a direct path, not ../../ from the working directory
    _, text = call_main(mstarc_cli.main, ["explain", str(plan)], capsys)
    assert f"mstarc compile {work / 'specs' / 'llama.mw'}" in text or "mstarc compile specs/" in text
    mstarc(["explain", "--no-verify", plan], capsys, 0, "plan llama")


def test_tampered_plan(plan, capsys):
    text = plan.read_text()
    assert '"num_pages": 8192' in text
    plan.write_text(text.replace('"num_pages": 8192', '"num_pages": 8193', 1))
    _refused(plan, capsys, "content hash mismatch")


def test_truncated_plan(plan, capsys):
    plan.write_text(plan.read_text()[:3000])
    _refused(plan, capsys, "is not valid JSON")


@pytest.mark.parametrize("content, fragment", [
    (b"hello\n", "is not valid JSON"),
    (b"[1, 2]\n", "has no header object"),
    (b"{}\n", "has no header object"),
    (b"\xff\xfe\x00bin", "cannot read plan"),
])
def test_plan_that_is_not_a_plan(tmp_path, capsys, content, fragment):
    path = tmp_path / "x.plan"
    path.write_bytes(content)
    _refused(path, capsys, fragment)


def test_missing_plan_path(tmp_path, capsys):
    _refused(tmp_path / "nope.plan", capsys, "does not exist")
    _refused(tmp_path, capsys, "cannot read plan")


def test_plan_schema_violation_with_a_matching_hash(plan, capsys):
    """A hand edit that also fixed the content hash still fails schema validation cleanly."""
    data = json.loads(plan.read_text())
    data["deployment"]["kv_pools"][0]["num_pages"] = "many"
    plan.write_text(json.dumps(data))
    _refused(plan, capsys, "does not match the plan schema")


def test_explain_every_generated_plan(capsys):
    for path in sorted((ROOT / "generated").glob("*.plan")):
        mstarc(["explain", path], capsys, 0, f" / {path.stem} ")


# ---------------------------------------------------------------- mstar run

LLAMA = ROOT / "generated" / "llama.plan"
RUN = ["run", "--plan", LLAMA, "--no-progress"]


def _prompts(tmp_path, *lines) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


GOOD = {"id": "a", "prompt_tokens": [1, 2, 3], "max_tokens": 4}


@pytest.mark.parametrize("lines, fragment", [
    ([GOOD, "{bad json\n"], "prompts.jsonl:2: not valid JSON"),
    ([{"id": "a", "prompt_tokens": [1, 2]}], ":1: missing required field 'max_tokens'"),
    ([{**GOOD, "max_tokens": -1}], "'max_tokens' must be >= 1"),
    ([{**GOOD, "max_tokens": 0}], "'max_tokens' must be >= 1"),
    ([{**GOOD, "max_tokens": True}], "'max_tokens' must be int"),
    ([{**GOOD, "prompt_tokens": [1, -2]}], "non-negative integers"),
    ([{**GOOD, "prompt_tokens": []}], "non-empty list"),
    ([{**GOOD, "prompt_tokens": [1.5]}], "non-negative integers"),
    ([{**GOOD, "temperature": -1}], "'temperature' must be >= 0"),
    ([{**GOOD, "top_p": 0}], "'top_p' must be in (0, 1]"),
    ([GOOD, GOOD], "duplicate"),
    ([{**GOOD, "colour": "red"}], "unknown field"),
    ([], "no requests in the file"),
])
def test_bad_prompts_file(tmp_path, capsys, lines, fragment):
    mstar([*RUN, "--engine", "sim", "--prompts", _prompts(tmp_path, *lines)], capsys, 1, fragment)


def test_missing_prompts_file(tmp_path, capsys):
    mstar([*RUN, "--engine", "sim", "--prompts", tmp_path / "nope.jsonl"], capsys, 1,
          "cannot read prompts file")


def test_request_too_big_for_the_kv_pool_fails_alone(tmp_path, capsys):
    prompts = _prompts(tmp_path, {"id": "big", "prompt_tokens": [1] * 200, "max_tokens": 8},
                       *({"id": f"s{i}", "prompt_tokens": [1, 2, 3], "max_tokens": 4} for i in range(3)))
    text = mstar([*RUN, "--prompts", prompts, "--kv-pages", 4], capsys, 0, "4 (3 ok, 1 failed)")
    assert "request big failed" in text and "the pool has only 4" in text


def test_kv_pages_one_fails_every_request_cleanly(capsys):
    """Every request is run and reported; none ended well, so the command exits 1."""
    text = mstar([*RUN, "--requests", 2, "--kv-pages", 1], capsys, 1, "2 (0 ok, 2 failed)")
    assert "mstar: error: every request failed (2)" in text


@pytest.mark.parametrize("argv, status, fragment", [
    (["--kv-pages", 0], 1, "--kv-pages must be a positive"),
    (["--kv-pages", -3], 1, "--kv-pages must be a positive"),
    (["--requests", -1], 1, "--requests must be >= 0"),
    (["--prompt-len", "5..2"], 1, "need 1 <= A <= B"),
    (["--prompt-len", "0..2"], 1, "need 1 <= A <= B"),
    (["--output-len", "x"], 1, "--output-len"),
    (["--concurrency", 0], 1, "--concurrency must be >= 1"),
    (["--arrival", "poisson", "--rate", 0], 2, "argument --rate: must be a number in (0, 1e+09], got 0.0"),
    (["--route", "garbage"], 1, "expected PARTITION=WALK,WALK"),
    (["--requests", "many"], 2, "argument --requests: must be an integer, got 'many'"),
    (["--engine", "gpu"], 2, "invalid choice"),
])
def test_bad_run_options(capsys, argv, status, fragment):
    mstar([*RUN, "--engine", "sim", *argv], capsys, status, fragment)


def test_zero_requests(capsys):
    mstar([*RUN, "--engine", "sim", "--requests", 0], capsys, 0, "0 (0 ok, 0 failed)")


def test_bad_weights_dirs(tmp_path, capsys):
    mstar([*RUN, "--weights", tmp_path / "nope"], capsys, 1, "nope: no such directory")
    (tmp_path / "config.json").write_text("not json")
    mstar([*RUN, "--weights", tmp_path], capsys, 1, "config.json: not valid JSON")
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    mstar([*RUN, "--weights", tmp_path], capsys, 1, "is not one the engine loads")


def test_weights_for_the_wrong_node(tmp_path, capsys):
    """A plan with several kv nodes needs NODE=DIR; an unknown or repeated node is refused."""
    omni = ["run", "--plan", str(Path(LLAMA).parent / "qwen3_omni.plan"), "--no-progress"]
    mstar([*omni, "--weights", tmp_path], capsys, 1, "the plan has 2 kv nodes (Thinker, Talker); name the one")
    mstar([*RUN, "--weights", f"Thinker={tmp_path}"], capsys, 1,
          "'Thinker' is not a kv or audio codec node of the plan (those nodes: LLM)")
    mstar([*RUN, "--weights", f"LLM={tmp_path}", "--weights", f"LLM={tmp_path}"], capsys, 1,
          "node LLM already gets")


def test_token_id_outside_the_vocabulary_fails_alone(tmp_path, capsys):
    """A prompt id past the spec's vocab=128256 is refused (it would silently feed another token
    with --weights); the other request of the file still finishes."""
    prompts = _prompts(tmp_path, {"id": "past", "prompt_tokens": [1, 128256, 99_999_999], "max_tokens": 3},
                       {"id": "fine", "prompt_tokens": [1, 128255], "max_tokens": 3})
    out = mstar([*RUN, "--prompts", prompts], capsys, 0, "2 (1 ok, 1 failed)")
    assert "outside the vocabulary [0, 128256)" in out


def test_infinite_capture_budget_is_refused(work, capsys):
    for value in (".inf", ".nan"):
        config = _yaml(work, "bad", f'model: "orpheus"\nmax_seq_len: 1024\ncapture_memory_budget_mb: {value}\n'
                       + ORPHEUS_GROUPS)
        mstarc(["check", work / "specs" / "orpheus.mw", "--config", config], capsys, 1,
               "is not a finite number")


def test_kv_pool_too_large_to_allocate(capsys):
    """A page count the host cannot hold stops the run at start-up with a message, not a
    MemoryError (the sim engine keeps no KV tensors, so it runs)."""
    mstar([*RUN, "--requests", 1, "--kv-pages", 10**14], capsys, 1, "cannot allocate a KV cache")
    mstar([*RUN, "--engine", "sim", "--requests", 1, "--kv-pages", 10**14], capsys, 0, "1 (1 ok, 0 failed)")


def test_no_config_and_no_default_config(tmp_path, capsys):
    spec = tmp_path / "specs" / "llama.mw"
    spec.parent.mkdir()
    shutil.copy(ROOT / "specs" / "llama.mw", spec)
    for command in ("check", "compile"):
        mstarc([command, spec], capsys, 1, "no --config given, and the default deployment for model 'llama'")


def test_compile_into_a_directory(work, capsys):
    out = work / "out"
    out.mkdir()
    mstarc(["compile", work / "specs" / "llama.mw", "-o", out], capsys, 0, "wrote")
    assert (out / "llama.plan").is_file() and (out / "llama_glue.py").is_file()


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "hidden_act": "silu"}


def test_bad_checkpoints(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    mstar([*RUN, "--weights", tmp_path], capsys, 1, "no *.safetensors files")
    (tmp_path / "model.safetensors").write_text("not a safetensors file")
    mstar([*RUN, "--weights", tmp_path], capsys, 1, "cannot read model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "num_attention_heads": "four"}))
    mstar([*RUN, "--weights", tmp_path], capsys, 1, "config.json: num_attention_heads must be a positive integer")
    (tmp_path / "config.json").write_text("[1, 2]")
    mstar([*RUN, "--weights", tmp_path], capsys, 1, "config.json: not a JSON object")


@pytest.mark.parametrize("route, fragment", [
    ("Nope=prefill", "--route: unknown partition 'Nope'"),
    ("LLM=nope", "partition 'LLM' has no walk 'nope'"),
    ("LLM=prefil", "did you mean 'prefill'?"),
    ("LMM=prefill", "did you mean 'LLM'?"),
])
def test_route_unknown_to_the_plan_is_refused_before_the_run(capsys, route, fragment):
    mstar([*RUN, "--engine", "sim", "--route", route], capsys, 1, fragment)


def test_prompts_file_route_unknown_to_the_plan_names_the_line(tmp_path, capsys):
    prompts = _prompts(tmp_path, GOOD, {**GOOD, "id": "b", "route": {"LLM": ["prefil", "decode"]}})
    mstar([*RUN, "--engine", "sim", "--prompts", prompts], capsys, 1,
          "prompts.jsonl:2: partition 'LLM' has no walk 'prefil'; did you mean 'prefill'?")


def test_unwritable_outputs_are_refused_before_the_run(tmp_path, capsys):
    existing = tmp_path / "file.txt"
    existing.write_text("x")
    mstar([*RUN, "--engine", "sim", "--report", tmp_path], capsys, 1, f"--report {tmp_path} is a directory")
    mstar([*RUN, "--engine", "sim", "--timeline", tmp_path], capsys, 1, "--timeline")
    text = mstar([*RUN, "--engine", "sim", "--out", existing], capsys, 1, "--out")
    assert "is not a directory" in text and "requests/s" not in text  # nothing ran
    mstar([*RUN, "--engine", "sim", "--report", existing / "r.json"], capsys, 1, "--report")


def test_output_parents_are_created(tmp_path, capsys):
    report, out = tmp_path / "a" / "b" / "r.json", tmp_path / "c" / "out"
    mstar([*RUN, "--engine", "sim", "--requests", 2, "--report", report, "--out", out], capsys, 0, "2 (2 ok")
    assert report.is_file() and (out / "outputs.jsonl").is_file()


def test_failures_are_grouped_in_the_table_and_listed_below(tmp_path, capsys):
    report = tmp_path / "r.json"
    text = mstar([*RUN, "--engine", "sim", "--requests", 8, "--kv-pages", 1, "--report", report], capsys, 1,
                 "error: 8")
    lines = [line for line in text.splitlines() if line.startswith("mstar: ")]
    assert len(lines) == 7 and lines[-2].startswith("mstar: and 3 more")
    assert lines[-1].startswith("mstar: error: every request failed (8)")
    summary = json.loads(report.read_text())
    assert summary["finish_kinds"] == {"error": 8} and len(summary["failed_requests"]) == 8
    assert all(reason.startswith("error: can never fit") for reason in summary["failed_requests"].values())


def test_zero_requests_show_no_latency_numbers(tmp_path, capsys):
    report = tmp_path / "r.json"
    text = mstar([*RUN, "--engine", "sim", "--requests", 0, "--report", report], capsys, 0, "- / - / -")
    assert "0.00 / 0.00" not in text
    summary = json.loads(report.read_text())
    assert summary["ttft_ms"]["p50"] is None and summary["itl_ms"]["mean"] is None


# ---------------------------------------------------------------- found by fuzzing the CLIs

@pytest.mark.parametrize("text, fragment", [
    # a binary file was a UnicodeDecodeError traceback
    (b"\xff\xfe\x00bin\n", "prompts.jsonl: not UTF-8 text (byte 0xff at offset 0)"),
    # an integer literal past Python's 4300-digit limit was a ValueError traceback
    (b'{"id": "a", "prompt_tokens": [1], "max_tokens": 1' + b"0" * 5000 + b"}\n",
     "prompts.jsonl:1: a number on this line has too many digits to read"),
    # arrays nested past the recursion limit were an internal error (RecursionError)
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "prompts.jsonl:1: the line's JSON is nested too deeply to read"),
    (b'{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "route": ' + b'{"x": ' * 50_000 + b"1" + b"}" * 50_001
     + b"\n", "prompts.jsonl:1: the line's JSON is nested too deeply to read"),
    # an int past the float range was an OverflowError traceback
    (b'{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}\n",
     "field 'temperature' must be a finite number, got a 401-digit integer"),
    # NaN / Infinity (Python's json reads them) were accepted: a blank image, a NaN temperature
    (b'{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "guidance": {"cfg_img": Infinity}}\n',
     "field 'cfg_img' must be a finite number, got inf"),
    (b'{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "guidance": {"cfg_text": NaN}}\n',
     "field 'cfg_text' must be a finite number, got nan"),
    (b'{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "temperature": NaN}\n',
     "field 'temperature' must be a finite number"),
    (b'{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "repetition_penalty": Infinity}\n',
     "field 'repetition_penalty' must be a finite number"),
])
def test_unreadable_prompts_lines(tmp_path, capsys, text, fragment):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(text)
    mstar([*RUN, "--engine", "sim", "--prompts", path], capsys, 1, fragment)


def test_prompts_file_with_a_byte_order_mark(tmp_path, capsys):
    """A BOM (as some editors write) was refused as 'Unexpected UTF-8 BOM'; it is skipped."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    mstar([*RUN, "--engine", "sim", "--prompts", path], capsys, 0, "1 (1 ok, 0 failed)")


@pytest.mark.parametrize("argv, fragment", [
    # each of these hung: no requests ever admitted, or a workload too big to build
    (["--prompts", "PROMPTS", "--concurrency", 0], "--concurrency must be >= 1, got 0"),
    (["--prompts", "PROMPTS", "--concurrency", -3], "--concurrency must be >= 1, got -3"),
    (["--requests", 10**30], "--requests must be at most 10000000"),
    (["--prompt-len", 10**30], "--prompt-len must be at most 1000000 tokens"),
])
def test_workload_options_that_hung(tmp_path, capsys, argv, fragment):
    prompts = _prompts(tmp_path, GOOD)
    argv = [prompts if a == "PROMPTS" else a for a in argv]
    mstar([*RUN, "--engine", "sim", *argv], capsys, 1, fragment)


def test_a_timeline_drawing_that_fails_is_an_error_line_after_the_outputs(tmp_path, capsys, monkeypatch):
    from mstar.runtime.serve import timeline

    def fails(*args, **kwargs):
        raise RuntimeError("'xelatex' not found")

    monkeypatch.setattr(timeline, "draw", fails)
    out = tmp_path / "out"
    mstar([*RUN, "--engine", "sim", "--requests", 2, "--out", out, "--timeline", tmp_path / "t.png"], capsys, 1,
          "--timeline: matplotlib could not draw")
    assert len((out / "outputs.jsonl").read_text().splitlines()) == 2


def test_timeline_in_a_format_matplotlib_cannot_write(tmp_path, capsys):
    """`--timeline x.txt` ran the whole workload, then died with matplotlib's ValueError."""
    text = mstar([*RUN, "--engine", "sim", "--requests", 1, "--timeline", tmp_path / "t.txt"], capsys, 1,
                 "cannot draw a .txt file; name it .png")
    assert "requests/s" not in text  # refused before the run
    # .pgf is matplotlib's, through an installed LaTeX: it ran the workload, then an internal error
    text = mstar([*RUN, "--engine", "sim", "--requests", 1, "--timeline", tmp_path / "t.pgf"], capsys, 1,
                 "cannot draw a .pgf file; name it .png")
    assert "requests/s" not in text
    assert text.count(".png") == 1, text  # the list of the other formats named .png again
    # no suffix: a PNG at exactly that path (matplotlib alone would write t.png)
    mstar([*RUN, "--engine", "sim", "--requests", 1, "--timeline", tmp_path / "t"], capsys, 0, "1 (1 ok")
    assert (tmp_path / "t").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "t.png").exists()


def test_bench_with_a_root_that_is_no_repository(tmp_path, capsys):
    """`mstarc bench --root /nonexistent` was an internal error (FileNotFoundError)."""
    mstarc(["bench", "--runs", 1, "--root", tmp_path / "nope"], capsys, 1, "has no configs/ and no specs/")


def test_an_unexpected_error_is_reported_without_a_traceback(monkeypatch, capsys):
    """A bug (or a hand-edited plan whose hash was recomputed) ends with a one-line message."""
    def broken(args):
        raise KeyError("LLM")
    monkeypatch.setattr(mstar_cli, "run_command", broken)
    status, text = call_main(mstar_cli.main, RUN, capsys)  # _expect refuses "internal error" itself
    assert status == 1 and "Traceback" not in text
    assert "internal error (KeyError: 'LLM'); this is a bug in mstar" in text
