"""A checkpoint's chat template runs in a bounded sandbox (serve/chat_template.py): any error it
raises is the template's error naming tokenizer_config.json (a ZeroDivisionError was `mstar:
internal error` and a 500), and what one render may allocate or loop over is bounded (`'x' *
10**9` took a host's memory, two nested range(100000) loops ran past a minute); real templates,
which loop over the messages, render as before."""
from __future__ import annotations

import json

import pytest

from mstar.runtime.serve.chat_template import MAX_RANGE_ITEMS, MAX_TEXT, ChatTemplateError, compile_template
from mstar.runtime.serve.tokenizer import TokenizerError, load_tokenizer
from serve_harness import TEMPLATE, write_tokenizer

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("source, words", [
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ messages + 1 }}", "TypeError"),
    ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "RecursionError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ 'x' * 10**9 }}", f"repeats a sequence past {MAX_TEXT} items"),
    ("{{ [0] * 10**9 }}", f"repeats a sequence past {MAX_TEXT} items"),
    ("{{ 10 ** (10 ** 9) }}", "raises an integer past 4096 bits"),  # (jinja reads a ** b ** c left to right)
    ("{{ 'x'.ljust(10**9) }}", f"pads text past {MAX_TEXT} characters"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     f"more than {MAX_RANGE_ITEMS} items from range"),
])
def test_a_template_that_fails_or_overreaches_is_the_templates_error(source, words):
    template = compile_template(source, "tok/tokenizer_config.json")
    with pytest.raises(ChatTemplateError) as failed:
        template.render(messages=MESSAGES, add_generation_prompt=True)
    message = str(failed.value)
    assert message.startswith("tok/tokenizer_config.json: the chat template failed on these messages")
    assert words in message


def test_what_real_templates_do_renders_as_before():
    source = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{{ m['content'] | trim }}{% endfor %}"
              "{{ '-' * 20 }}{{ 2 ** 10 }}{% for i in range(3) %}{{ i }}{% endfor %}{{ 'ab'.center(6) }}")
    text = compile_template(source, "t").render(messages=MESSAGES + [{"role": "assistant", "content": " hi "}])
    assert text == "<|user|>hello<|assistant|>hi" + "-" * 20 + "1024" + "012" + "  ab  "
    # the budget is a render's: a second render has its own
    template = compile_template("{% for i in range(60000) %}{% endfor %}ok", "t")
    assert template.render() == "ok" and template.render() == "ok"


def test_the_tokenizer_says_which_file_failed(tmp_path):
    directory = write_tokenizer(tmp_path / "tok")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert load_tokenizer(str(directory)).render_chat(MESSAGES).startswith("<s><|user|> hello")
    assert config["chat_template"] == TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 1 // 0 }}"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: the chat template failed on these messages: "
                                             r"ZeroDivisionError"):
        load_tokenizer(str(directory)).render_chat(MESSAGES)
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="chat_template is not a valid template"):
        load_tokenizer(str(directory)).render_chat(MESSAGES)


@pytest.mark.parametrize("source", [
    # a string doubled in a loop by `~`: each step within every per-operation bound
    "{% set ns = namespace(v='x' * 4000000) %}{% for i in range(40) %}{% set ns.v = ns.v ~ ns.v %}{% endfor %}"
    "{{ ns.v[:5] }}",
    "{{ '{:>999999999}'.format(1) }}",  # a width in a format spec
    "{{ (['x' * 4000000] * 4000000) | join }}",  # one 4 MB string, referenced 4 million times, joined
    "{{ '%0999999999d' % 1 }}",  # folded when the template compiles
])
def test_a_template_that_grows_past_the_workers_memory_fails_alone(source):
    """Each took a host's memory past 6 GB in this process; in the worker each fails with its
    address space's MemoryError (or its rendered text's bound), and the next template renders."""
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json: .*MemoryError \(past the 512 MiB"):
        compile_template(source, "tok/tokenizer_config.json").render(messages=MESSAGES)
    assert compile_template("{{ messages[0]['content'] }}", "t").render(messages=MESSAGES) == "hello"


def test_a_render_past_its_time_is_killed_and_the_next_gets_a_fresh_worker(monkeypatch):
    from mstar.runtime.serve import chat_template

    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 1.0)
    # 2**40 macro calls, each within every bound: only the time stops it
    slow = "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(40) }}"
    with pytest.raises(ChatTemplateError, match="ran past 1 s"):
        compile_template(slow, "tok/tokenizer_config.json").render(messages=MESSAGES)
    assert compile_template("{{ 2 + 2 }}", "t").render() == "4"


def test_the_worker_runs_isolated_from_the_working_directory(tmp_path, monkeypatch):
    """A module planted in the working directory (or named by PYTHONPATH) is not what the worker
    imports."""
    from mstar.runtime.serve import chat_template

    (tmp_path / "jinja2").mkdir()
    (tmp_path / "jinja2" / "__init__.py").write_text("raise SystemExit('planted')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    worker = chat_template.TemplateWorker()
    monkeypatch.setattr(chat_template, "_the_worker", worker)
    try:
        assert compile_template("{{ 'ok' }}", "t").render() == "ok"
    finally:
        worker.close()
