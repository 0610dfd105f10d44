"""`mstarc init --from-checkpoint LLM --codec-checkpoint SNAC`: a tiny random Orpheus in its
published layouts becomes a spec and a deployment (dims, prompt format, stop token, audio token
range and window from the two directories), which compile and run: a text prompt with a voice
gives transformers' greedy tokens from Orpheus's framed prompt, and a WAV of the audio tokens
through SNAC, equal to the checked-in Orpheus spec's."""
import json
from pathlib import Path

import pytest

from mstar.cli.mstar import main as mstar_main
from mstar.cli.mstarc import main as mstarc_main
from orpheus_checkpoint import (
    END_OF_HUMAN,
    END_OF_TEXT,
    START_OF_AI,
    START_OF_HUMAN,
    START_OF_SPEECH,
    hf_greedy,
    orpheus_decode,
    save_models,
)

pytest.importorskip("transformers")
pytest.importorskip("snac")
pytest.importorskip("tokenizers")


def _run(plan: Path, root: Path, out: Path, capsys) -> dict:
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "hello there", "voice": "tara", "max_tokens": 40,
                                   "temperature": 0}) + "\n")
    status = mstar_main(["run", "--plan", str(plan), "--weights", f"LLM={root / 'llm'}",
                         "--weights", f"snac_decoder={root / 'snac'}", "--prompts", str(prompts),
                         "--out", str(out), "--no-progress"])
    assert status == 0, capsys.readouterr()
    return json.loads((out / "outputs.jsonl").read_text())


def test_init_writes_an_orpheus_spec_that_runs(tmp_path, capsys):
    llm, codec = save_models(tmp_path)
    spec, config, plan = tmp_path / "orph.mw", tmp_path / "orph.yaml", tmp_path / "orph.plan"
    status = mstarc_main(["init", "--from-checkpoint", str(tmp_path / "llm"), "--codec-checkpoint",
                          str(tmp_path / "snac"), "--name", "orph", "-o", str(spec), "--config-out", str(config),
                          "--plan-out", str(plan)])
    assert status == 0, capsys.readouterr()
    text = spec.read_text()
    assert "stop_token=128258" in text and "audio_codec(token_offset=128266)" in text
    assert "window(28, stride=7) keep 128266..156937" in text
    line = _run(plan, tmp_path, tmp_path / "out", capsys)
    framed = [START_OF_HUMAN, 1, 3, 4, 5, 6, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
    assert line["output_tokens"] == hf_greedy(llm, framed, len(line["output_tokens"]))
    [wav] = (tmp_path / "out").glob("*.wav")
    assert wav.stat().st_size > 44 and len(orpheus_decode(codec, line["output_tokens"])) > 0
    checked_in = Path(__file__).resolve().parents[2] / "generated" / "orpheus.plan"
    assert _run(checked_in, tmp_path, tmp_path / "out2", capsys)["output_tokens"] == line["output_tokens"]
    [wav2] = (tmp_path / "out2").glob("*.wav")
    assert wav2.read_bytes() == wav.read_bytes()


def test_codec_checkpoint_without_orpheus_tokens_is_refused(tmp_path, capsys):
    save_models(tmp_path)
    tokenizer = json.loads((tmp_path / "llm" / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<custom_token_10>"]
    del tokenizer["model"]["vocab"]["<custom_token_10>"]
    (tmp_path / "llm" / "tokenizer.json").write_text(json.dumps(tokenizer))
    status = mstarc_main(["init", "--from-checkpoint", str(tmp_path / "llm"), "--codec-checkpoint",
                          str(tmp_path / "snac"), "--name", "orph", "-o", str(tmp_path / "o.mw"),
                          "--config-out", str(tmp_path / "o.yaml")])
    assert status != 0
    assert "no token <custom_token_10>" in capsys.readouterr().err
    (tmp_path / "snac2").mkdir()
    status = mstarc_main(["init", "--from-checkpoint", str(tmp_path / "llm"), "--codec-checkpoint",
                          str(tmp_path / "snac2"), "--name", "orph", "-o", str(tmp_path / "o.mw"), "--force",
                          "--config-out", str(tmp_path / "o.yaml")])
    assert status != 0


@pytest.mark.parametrize("token_id", [True, -5, 10**20])
def test_a_token_id_that_is_not_one_is_refused_naming_the_tokenizer(tmp_path, capsys, token_id):
    """tokenizer.json's id of <custom_token_3> a bool, negative or past 2**31: refused naming the
    file and the token, nothing written (the spec was written with `keep True..` or `-5` and failed
    to compile on its own text)."""
    save_models(tmp_path)
    path = tmp_path / "llm" / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["added_tokens"] = [dict(t, id=token_id) if t["content"] == "<custom_token_3>" else t
                                 for t in tokenizer["added_tokens"]]
    path.write_text(json.dumps(tokenizer))
    status = mstarc_main(["init", "--from-checkpoint", str(tmp_path / "llm"), "--codec-checkpoint",
                          str(tmp_path / "snac"), "--name", "orph", "-o", str(tmp_path / "o.mw"),
                          "--config-out", str(tmp_path / "o.yaml")])
    err = capsys.readouterr().err
    assert status == 1 and f"{path}: token <custom_token_3> has id {token_id!r}, not a token id" in err
    assert not (tmp_path / "o.mw").exists() and not (tmp_path / "o.yaml").exists()
