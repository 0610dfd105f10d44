"""MW411 at its limits: a cap, a captured batch, a step's tokens, a family's graphs and a combined
walk's walks may each be exactly what the runtime holds (memory_bounds.py), and one more is refused.
The golden fixture's sizes are 1,500 times the limit, so a check that was off by one, or that
counted a batched capture's tokens or a packed one's graphs wrongly, passed it."""
import pytest

from checks_golden import check_texts
from mstar.compiler.memory_bounds import MAX_CAPTURE_KEYS, MAX_COMBINED_WALKS, MAX_STEP_ROWS, MAX_STEP_TOKENS

SPEC = """model m
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    %s
}
walk prefill {
    LLM(text_inputs) -> new_token: conductor persist
}
walk decode {
    loop decode_loop max=64 stop {
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }
}
partition P = prefill -> decode
"""


def _sizes(n: int) -> str:
    return ", ".join(str(i) for i in range(1, n + 1))


def _codes(body: str) -> list[tuple[str, int]]:
    return [(d.code, d.span.line) for d in check_texts(SPEC % body).sorted()]


@pytest.mark.parametrize("body", [
    f"cap decode {MAX_STEP_ROWS}\n    capture decode batched batch=[1, {MAX_STEP_ROWS}]",
    f"combine mixed = prefill + decode {{\n        cap {MAX_STEP_ROWS}\n    }}",
    f"capture prefill packed batch=[1] tokens=[{MAX_STEP_TOKENS}]",
    # a batched step holds batch x tokens_per_row tokens: 65,536 x 16 = 2**20
    f"capture decode batched batch=[1, {MAX_STEP_ROWS}] tokens_per_row={MAX_STEP_TOKENS // MAX_STEP_ROWS}",
    # 64 batch sizes x 64 token buckets = 4,096 graphs
    f"capture prefill packed batch=[{_sizes(64)}] tokens=[{_sizes(MAX_CAPTURE_KEYS // 64)}]",
])
def test_sizes_at_the_limit_pass(body):
    assert _codes(body) == []


@pytest.mark.parametrize("body, fragment", [
    (f"cap decode {MAX_STEP_ROWS + 1}\n    capture decode batched batch=[1, {MAX_STEP_ROWS}]",
     f"cap decode {MAX_STEP_ROWS + 1} is more rows"),
    (f"capture decode batched batch=[1, {MAX_STEP_ROWS + 1}]", f"capture batch size {MAX_STEP_ROWS + 1} is more rows"),
    (f"combine mixed = prefill + decode {{\n        cap {MAX_STEP_ROWS + 1}\n    }}",
     f"cap {MAX_STEP_ROWS + 1} is more rows"),
    (f"capture prefill packed batch=[1] tokens=[{MAX_STEP_TOKENS + 1}]", f"capture of {MAX_STEP_TOKENS + 1} tokens"),
    # 65,536 rows x 17 tokens a row: each batch size alone is within the limits, the step is not
    (f"capture decode batched batch=[1, {MAX_STEP_ROWS}] tokens_per_row=17", f"capture of {MAX_STEP_ROWS * 17} tokens"),
    (f"capture prefill packed batch=[{_sizes(65)}] tokens=[{_sizes(MAX_CAPTURE_KEYS // 64)}]",
     f"capture of {65 * MAX_CAPTURE_KEYS // 64} graphs"),
])
def test_one_past_the_limit_is_refused_on_its_line(body, fragment):
    diags = check_texts(SPEC % body)
    assert [(d.code, d.span.line) for d in diags.sorted()] == [("MW411", 6)]
    assert fragment in diags.render()


def _combined_spec(num_walks: int) -> str:
    walks = [f"w{i}" for i in range(num_walks)]
    return ("model m\nnode LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {\n"
            "    in text_inputs: tokens prompt text\n    out new_token: tokens\n"
            f"    combine all = {' + '.join(walks)} {{\n        cap 4\n    }}\n}}\n"
            + "".join(f"walk {w} {{\n    LLM(text_inputs) -> new_token: client text\n}}\n" for w in walks)
            + f"partition P = {' | '.join(walks)}\n")


def test_a_combined_walk_may_mix_exactly_the_most_walks():
    assert check_texts(_combined_spec(MAX_COMBINED_WALKS)).sorted() == []
    assert [d.code for d in check_texts(_combined_spec(MAX_COMBINED_WALKS + 1)).sorted()] == ["MW411"]


def test_a_step_size_past_the_limit_is_reported_alone():
    """The capture checks after MW411 read a capture's sizes; they do not run on a node that has
    one (a cap of 100,000 rows above a capture of 2 is not also MW405)."""
    assert _codes("cap decode 100000\n    capture decode batched batch=[1, 2]") == [("MW411", 6)]
