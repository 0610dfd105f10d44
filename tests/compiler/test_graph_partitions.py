"""`mstarc graph` draws the streams between partitions, and writes SVG only."""
from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree

from mstar.cli.mstarc import main
from mstar.compiler.graph_partitions import stage_text
from mstar.compiler.lower_walks import lower_partitions
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def _boxes_and_streams(path: Path) -> tuple[dict[str, tuple[float, float]], list[tuple[float, float]], str]:
    root = ElementTree.parse(path).getroot()
    elements = list(root.iter())
    boxes = {}
    for index, element in enumerate(elements):
        if element.tag == f"{SVG}text" and (element.text or "").startswith("partition ") and \
                elements[index - 1].tag == f"{SVG}rect":
            rect = elements[index - 1]
            boxes[element.text.split()[1]] = (float(rect.get("x")), float(rect.get("x")) + float(rect.get("width")))
    arrows = [(float(e.get("x1")), float(e.get("x2"))) for e in elements
              if e.tag == f"{SVG}line" and e.get("marker-end") == "url(#arrow-stream)"]
    text = " ".join(e.text or "" for e in elements if e.tag == f"{SVG}text")
    return boxes, arrows, text


def test_qwen3_omni_streams_thinker_to_talker_to_code2wav(tmp_path):
    out = tmp_path / "omni.svg"
    assert main(["graph", str(ROOT / "specs" / "qwen3_omni.mw"), "-o", str(out)]) == 0
    boxes, arrows, text = _boxes_and_streams(out)
    assert boxes["Thinker"][1] < boxes["Talker"][0] and boxes["Talker"][1] < boxes["Code2Wav"][0]
    # two streams Thinker -> Talker, one Talker -> Code2Wav, each from a right edge to a left edge
    assert sorted(arrows) == sorted([(boxes["Thinker"][1], boxes["Talker"][0] - 2)] * 2
                                    + [(boxes["Talker"][1], boxes["Code2Wav"][0] - 2)])
    for expected in ("thinker_states", "thinker_mask", "fixed(1, continue_after_done)", "codec_tokens",
                     "left_context(chunk=25, context=25)", "client: audio", "started by its streams"):
        assert expected in text


def test_orpheus_snac_is_fed_by_the_llm(tmp_path):
    out = tmp_path / "orpheus.svg"
    assert main(["graph", str(ROOT / "specs" / "orpheus.mw"), "-o", str(out)]) == 0
    boxes, arrows, text = _boxes_and_streams(out)
    assert arrows == [(boxes["LLM"][1], boxes["SNAC"][0] - 2)]
    assert "window(28, stride=7)" in text and "prefill -> decode" in text


def test_whisper_partition_says_it_repeats_per_window(tmp_path):
    """A partition's `repeat while VALUE max=N` (Whisper's 30 s windows) is written in its box."""
    out = tmp_path / "whisper.svg"
    assert main(["graph", str(ROOT / "specs" / "whisper.mw"), "-o", str(out)]) == 0
    _, _, text = _boxes_and_streams(out)
    assert "repeats while audio_left (at most " in text
    llama = tmp_path / "llama.svg"
    assert main(["graph", str(ROOT / "specs" / "llama.mw"), "-o", str(llama)]) == 0
    assert "repeats while" not in _boxes_and_streams(llama)[2]


def test_a_spec_without_streams_has_no_stream_arrows(tmp_path):
    out = tmp_path / "llama.svg"
    assert main(["graph", str(ROOT / "specs" / "llama.mw"), "-o", str(out)]) == 0
    boxes, arrows, _ = _boxes_and_streams(out)
    assert list(boxes) == ["LLM"] and arrows == []


def test_png_and_other_formats_are_refused(tmp_path, capsys):
    for name in ("x.png", "x.PNG", "x.pdf", "x"):
        out = tmp_path / name
        assert main(["graph", str(ROOT / "specs" / "orpheus.mw"), "-o", str(out)]) == 2
        assert "writes SVG only" in capsys.readouterr().err
        assert not out.exists()


def test_stages_are_drawn_as_the_spec_writes_them(tmp_path):
    """A sequence inside an optional alternative keeps its parentheses and its inner arrow, in the
    partition's box and in the legend: `(prefill_audio -> prefill_text)?`, not `prefill_audio |
    prefill_text?`; an optional stage of alternatives keeps its parentheses too."""
    for spec, expected in [
        ("higgs_audio", "prefill_text -> (prefill_audio -> prefill_text)? -> decode"),
        ("qwen3_omni", "prefill_text -> (prefill_audio | prefill_vision)? -> thinker_decode"),
        ("bagel", "prefill_vae? -> prefill_vit? -> prefill_text -> decode | image_gen"),
    ]:
        out = tmp_path / f"{spec}.svg"
        assert main(["graph", str(ROOT / "specs" / f"{spec}.mw"), "-o", str(out)]) == 0
        _, _, text = _boxes_and_streams(out)
        assert f"= {expected}" in text  # the legend's line
        assert "(prefill_audio | prefill_text)?" not in text and "prefill_audio | prefill_text?" not in text
    _, _, text = _boxes_and_streams(tmp_path / "higgs_audio.svg")
    assert text.count("(prefill_audio -> prefill_text)?") == 2  # the box and the legend


def test_stage_text_matches_the_formatter():
    for line in ["partition P = a -> (b -> a | c)? -> d", "partition P = a -> (b | c -> d) -> e",
                 "partition P = a? -> b | c", "partition P = (a | b)? -> c"]:
        spec = parse(f"model m\n{line}\n", "p.mw", Diagnostics())
        [partition] = lower_partitions(spec)
        drawn = " -> ".join(stage_text(stage) for stage in partition.stages)
        assert f"partition P = {drawn}" in format_spec(spec), (line, drawn)


def test_a_partition_says_where_a_default_request_starts(tmp_path):
    """BAGEL's first stages are optional: a request starts at prefill_text unless it asks for the
    image stages (its box said "starts at prefill_vae", the plan's first walk)."""
    out = tmp_path / "bagel.svg"
    assert main(["graph", str(ROOT / "specs" / "bagel.mw"), "-o", str(out)]) == 0
    text = _boxes_and_streams(out)[2]
    assert "starts at prefill_text or asked: prefill_vae / prefill_vit" in text
    assert "starts at prefill_vae" not in text
    orpheus = tmp_path / "orpheus.svg"
    assert main(["graph", str(ROOT / "specs" / "orpheus.mw"), "-o", str(orpheus)]) == 0
    assert "starts at prefill " in _boxes_and_streams(orpheus)[2] + " "


def test_a_loop_back_goes_around_the_edges_listed_under_its_box(tmp_path):
    """Orpheus's decode lists its stream edge under the LLM box and loops back to it: the loop-back
    leaves past the listed text's right end, runs under it and comes back in on the left (a curve
    between the box's sides crossed the text), and the loop's frame holds it."""
    out = tmp_path / "orpheus.svg"
    assert main(["graph", str(ROOT / "specs" / "orpheus.mw"), "-o", str(out)]) == 0
    elements = list(ElementTree.parse(out).getroot().iter())
    listed = next(e for e in elements if e.tag == f"{SVG}text" and (e.text or "").startswith("-> new_token: snac"))
    path = next(e for e in elements if e.tag == f"{SVG}path" and e.get("marker-end") == "url(#arrow-back)")
    moves = path.get("d").split()
    right, bottom = float(moves[1][1:]), float(moves[2][1:])
    text_x, text_y = float(listed.get("x")), float(listed.get("y"))
    assert right >= text_x + len(listed.text) * 10 * 0.62 and bottom > text_y
    frame = next(e for e in elements if e.tag == f"{SVG}rect" and e.get("stroke-dasharray") == "6 4")
    assert float(frame.get("x")) + float(frame.get("width")) > right
