"""A prompt format's fields may not take a request's own field names (`mstar/plan/request_fields.py`):
a format field `{seed}` was read both as the format's value and as the sampling seed, so a spec that
only renamed its `{voice}` to `{seed}` refused `"seed": "leo"` on a prompts line and over HTTP."""
from pathlib import Path

import pytest

from mstar.cli.mstarc import main
from mstar.plan.request_fields import LINE_FIELDS, REQUEST_FIELDS
from mstar.runtime.serve.http_schema import SpeechBody

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, refused", [("seed", True), ("max_tokens", True), ("route", True), ("model", True),
                                           ("speaker", False), ("instructions", False)])
def test_a_format_field_named_like_a_request_field_is_refused(tmp_path, capsys, name, refused):
    spec = (ROOT / "specs" / "orpheus.mw").read_text()
    assert '"{voice}: {prompt}"' in spec and ' voice="tara"' in spec
    renamed = tmp_path / "orpheus.mw"
    renamed.write_text(spec.replace("{voice}", "{" + name + "}").replace(' voice="tara"', f' {name}="tara"'))
    status = main(["check", str(renamed), "--config", str(ROOT / "configs" / "orpheus.yaml")])
    err = capsys.readouterr().err
    if refused:
        assert status == 1
        assert f"error[MW140]: prompt_format's field `{name}` is named like a request's own field" in err
    else:
        assert status == 0, err


def test_the_reserved_names_cover_the_speech_body_and_the_prompts_line():
    """The speech body's fields (but `voice` and `instructions`, which it gives to the format's
    fields of those names) and a prompts line's are all reserved."""
    speech = set(SpeechBody.model_fields) - {"voice", "instructions"}
    assert speech <= REQUEST_FIELDS and LINE_FIELDS <= REQUEST_FIELDS
    assert not {"voice", "instructions"} & REQUEST_FIELDS
