"""Cross-attention KV pool checks (check_cross.py) beyond their golden fixtures: a pool of no
tokens, a pool filled from the request's prompt, and a walk that fills the pool it reads."""
from pathlib import Path

from checks_golden import check_texts

FIXTURE = (Path(__file__).parent / "fixtures" / "MW430_offload_cross_attention.mw").read_text()


def _found(text: str) -> list[tuple[str, int, int]]:
    return [(d.code, d.span.line, d.span.col) for d in check_texts(text).sorted()]


def test_the_spec_without_offload_passes():
    assert _found(FIXTURE) == []


def test_a_pool_of_no_tokens_is_refused():
    diags = check_texts(FIXTURE.replace("tokens=1500", "tokens=0"))
    assert [(d.code, d.span.line) for d in diags.sorted()] == [("MW130", 14)]
    assert "tokens= must be at least 1" in diags.render()


def test_a_pool_filled_from_the_prompt_is_refused():
    """MW119 refuses a hidden prompt; MW130 says besides that a pool is another model's states."""
    prompted = FIXTURE.replace("    in encoder_states: hidden\n", "    in encoder_states: hidden prompt audio\n")
    diags = check_texts(prompted)
    assert [(d.code, d.span.line) for d in diags.sorted()] == [("MW119", 10), ("MW130", 14)]
    assert "its input encoder_states is the request's prompt" in diags.render()


def test_a_walk_that_fills_the_pool_it_reads_does_not_read_before_a_fill():
    """MW133 is for a walk that only reads a pool; one whose kv line also writes it fills the pool
    in its own call, before attending over it (runners/whisper.py fills, then reads), so no earlier
    walk has to. It was refused with 'no earlier walk of its partition fills it (filled by prefill)'."""
    assert _found(FIXTURE.replace("kv prefill writes main audio", "kv prefill reads audio writes main audio")) == []
    # a walk that only reads it at the first stage is still refused
    only_reads = FIXTURE.replace("partition P = prefill -> decode", "partition P = decode -> prefill")
    assert [d.code for d in check_texts(only_reads).sorted()] == ["MW133"]
