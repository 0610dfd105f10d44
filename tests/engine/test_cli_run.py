"""`mstar run --plan generated/<x>.plan` with the torch engine (tiny dims) for every spec, as a user
runs it: exit status 0, outputs.jsonl, and the media each model emits (WAV, PNG)."""
import json
from pathlib import Path

import pytest

from mstar.cli.mstar import main

GENERATED = Path(__file__).resolve().parents[2] / "generated"
CASES = {
    "llama": ([], []),
    "qwen3_5": ([], []),
    "orpheus": ([], [".wav"]),
    "bagel": (["--route", "LLM=prefill_text,image_gen"], [".png"]),
    "qwen3_omni": ([], [".wav"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mstar_run_writes_outputs_and_media(name, tmp_path, capsys):
    plan = GENERATED / f"{name}.plan"
    if not plan.exists():
        pytest.skip(f"{plan} not generated")
    extra, media = CASES[name]
    status = main(["run", "--plan", str(plan), "--requests", "2", "--output-len", "8..12", "--out", str(tmp_path),
                   "--no-progress", *extra])
    assert status == 0, capsys.readouterr()
    lines = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["finish_reason"] in ("stop", "length", "done") for line in lines)
    for suffix in media:
        files = sorted(tmp_path.glob(f"*{suffix}"))
        assert len(files) == 2 and all(f.stat().st_size > 44 for f in files)


def test_mstar_run_with_prompts_and_weights(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    plan = GENERATED / "llama.plan"
    if not plan.exists():
        pytest.skip(f"{plan} not generated")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_tokens": [1, 2, 3], "max_tokens": 5}) + "\n")
    status = main(["run", "--plan", str(plan), "--weights", str(tmp_path / "ckpt"), "--prompts", str(prompts),
                   "--out", str(tmp_path / "out"), "--no-progress"])
    assert status == 0, capsys.readouterr()
    line = json.loads((tmp_path / "out" / "outputs.jsonl").read_text())
    assert line["id"] == "p" and len(line["output_tokens"]) == 5
