"""A prompt cut into chunks on a node whose prompt walk sends a value per position (Qwen3-Omni's
Thinker streams its prompt's hidden states and mask to the Talker): its last chunk sends every
chunk's states, so the Talker's audio is that of the uncut prompt (it got the last chunk's alone
before, and its audio differed). And with a prefix cache, the Thinker's prompt walk is no prefix
walk (MW429): a cached prefix would send nothing for its positions."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from mstar.cli.mstar import main
from plan_variants import compiled
from runtime_plans import ROOT


def _plan(tmp_path: Path, name: str, edit) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "qwen3_omni.yaml").read_text())
    edit(config)
    deployment = tmp_path / f"{name}.yaml"
    deployment.write_text(yaml.safe_dump(config))
    return compiled(ROOT / "specs" / "qwen3_omni.mw", deployment, tmp_path)


def _run(tmp_path: Path, plan: Path, prompts: Path) -> dict[str, tuple]:
    out = tmp_path / f"out-{plan.stem}"
    assert main(["run", "--plan", str(plan), "--prompts", str(prompts), "--concurrency", "1", "--ranks", "inproc",
                 "--no-progress", "--out", str(out)]) == 0
    found = {}
    for line in (out / "outputs.jsonl").read_text().splitlines():
        record = json.loads(line)
        found[record["id"]] = (record["output_tokens"], [(out / name).read_bytes() for name in record["media"]])
    return found


def test_a_cut_thinker_prompt_streams_every_chunk_and_a_cached_prefix_is_not_taken(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    shared = list(range(1000, 1100))
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt_tokens": shared + [2000 + i], "max_tokens": 6})
                               + "\n" for i in range(3)))

    def chunked(config):
        config.setdefault("kv_pool", {}).setdefault("nodes", {})["Thinker"] = {"max_prefill_chunk_size": 40}

    def cached(config):
        config["prefix_cache"] = True

    whole = _run(tmp_path, _plan(tmp_path, "whole", lambda config: None), prompts)
    assert all(media for _, media in whole.values())
    assert _run(tmp_path, _plan(tmp_path, "chunked", chunked), prompts) == whole
    assert _run(tmp_path, _plan(tmp_path, "cached", cached), prompts) == whole
