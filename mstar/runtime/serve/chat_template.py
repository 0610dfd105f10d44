"""A checkpoint's chat template, compiled in a bounded sandbox.

In: the template's source (tokenizer_config.json's `chat_template`, which comes with a checkpoint
and is not trusted). Out: `compile_template(source, where)`, whose `render(**variables)` gives the
rendered text or raises `ChatTemplateError` with the template's own message.

Jinja's immutable sandbox keeps a template from reaching Python; it does not bound what a
template may allocate or how long it may loop. Each was seen: `{{ 'x' * 10**9 }}` took all of a
23 GB host's memory (killed), and two nested `range(100000)` loops ran on past a minute. Here a
render may build strings and lists of at most `MAX_TEXT` items by `*`, pad or justify text to at
most that width, raise integers to at most `MAX_POWER_BITS` bits, and take at most `MAX_RANGE_ITEMS`
items from `range` in all (every real template loops over the messages instead). Any error a
template raises, not only Jinja's (`{{ 1 // 0 }}`, `{{ messages + 1 }}`), is the template's error.
"""
from __future__ import annotations

import json
import operator
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_TEXT = 4 * 1024 * 1024  # items a `*`, a pad or a justify may make (a prompt is far shorter)
MAX_POWER_BITS = 4096  # bits of `a ** b` on integers
MAX_RANGE_ITEMS = 100_000  # items `range` may give in one render, all calls together
PADDING = {"ljust", "rjust", "center", "zfill", "expandtabs"}


class ChatTemplateError(Exception):
    """A template that does not compile, or one that failed on these messages (the message says why)."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            sized = [v for v in (left, right) if isinstance(v, (str, list, tuple))]
            counts = [v for v in (left, right) if isinstance(v, int) and not isinstance(v, bool)]
            if sized and counts and len(sized[0]) * max(counts[0], 0) > MAX_TEXT:
                raise SecurityError(f"the template repeats a sequence past {MAX_TEXT} items")
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * max(abs(left).bit_length() - 1, 1) > MAX_POWER_BITS:
                raise SecurityError(f"the template raises an integer past {MAX_POWER_BITS} bits")
        return operator.pow(left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's own)
        if getattr(__obj, "__name__", None) in PADDING and isinstance(getattr(__obj, "__self__", None), str):
            widths = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
            if any(w > MAX_TEXT for w in widths):
                raise SecurityError(f"the template pads text past {MAX_TEXT} characters")
        return super().call(__context, __obj, *args, **kwargs)


class _RangeBudget:
    """`range` for one render: every call's items count against one budget."""

    def __init__(self) -> None:
        self.left = MAX_RANGE_ITEMS

    def __call__(self, *args: int) -> range:
        found = range(*args)
        self.left -= len(found)
        if self.left < 0:
            raise SecurityError(f"the template takes more than {MAX_RANGE_ITEMS} items from range in one render")
        return found


class CompiledTemplate:
    def __init__(self, template: Any, where: str):
        self._template, self._where = template, where

    def render(self, **variables: Any) -> str:
        try:
            return self._template.render(range=_RangeBudget(), **variables)
        except Exception as error:  # a template's own: jinja's, a ZeroDivisionError, a RecursionError, ...
            said = str(error) if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {error}"
            raise ChatTemplateError(f"{self._where}: the chat template failed on these messages: {said}") from None


def compile_template(source: str, where: str) -> CompiledTemplate:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja2's own tojson escapes HTML characters, which chat templates do not want
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(form: str) -> str:
        return datetime.now().strftime(form)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return CompiledTemplate(env.from_string(source), where)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"{where}: chat_template is not a valid template (line {error.lineno}: "
                                f"{error.message})") from None
    except Exception as error:  # (a compile that fails otherwise: a nesting past Python's recursion limit)
        raise ChatTemplateError(f"{where}: chat_template cannot be compiled: {type(error).__name__}") from None
