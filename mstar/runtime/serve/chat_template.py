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

Those bounds are per operation, and a template has more ways to grow a value than operators to
intercept (`~` doubling a string in a loop, `'{:>999999999}'.format(1)`, a list of one 4 MB string
repeated 4 million times then joined: each took a host's memory past 6 GB). So templates compile
and render in a worker process (`TemplateWorker`, one a process, started at the first template):
its address space is capped at WORKER_MEMORY_BYTES (a template that grows past it fails with
MemoryError and the worker goes on), a render past RENDER_TIMEOUT_S is killed with its worker (the
next starts a fresh one), and a rendered text past MAX_TEXT characters is refused. The worker runs
isolated (`python -I`: neither the working directory nor PYTHON* variables on its path), with the
paths of mstar, jinja2 and markupsafe this process imported, so nothing planted beside it runs.
"""
from __future__ import annotations

import json
import operator
import os
import select
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_TEXT = 4 * 1024 * 1024  # items a `*`, a pad or a justify may make (a prompt is far shorter)
MAX_POWER_BITS = 4096  # bits of `a ** b` on integers
MAX_RANGE_ITEMS = 100_000  # items `range` may give in one render, all calls together
PADDING = {"ljust", "rjust", "center", "zfill", "expandtabs"}
WORKER_MEMORY_BYTES = 512 * 1024 * 1024  # the worker's address space (Python with jinja2: about 25 MB)
RENDER_TIMEOUT_S = 10.0  # a render past this is killed with its worker (real templates take under a ms)
_PAST_MEMORY = ("the chat template failed on these messages: MemoryError (past the "
                f"{WORKER_MEMORY_BYTES >> 20} MiB a render may take)")


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
    """A template the worker compiled; `render` has the worker render it."""

    def __init__(self, source: str, where: str):
        self._source, self._where = source, where

    def render(self, **variables: Any) -> str:
        return _worker().ask({"render": self._source, "variables": variables}, self._where)


def compile_template(source: str, where: str) -> CompiledTemplate:
    """The template, compiled by the worker: ChatTemplateError (naming `where`) for one that does not
    compile. (Compiling runs Jinja's constant folding, which a template can make allocate too.)"""
    _worker().ask({"compile": source}, where)
    return CompiledTemplate(source, where)


# ------------------------------------------------------------------ the worker process


class TemplateWorker:
    """The parent's end: one worker process, asked one request at a time (a lock), started again
    after one that died or ran past RENDER_TIMEOUT_S."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: Optional[subprocess.Popen] = None
        self.owner_pid = os.getpid()  # (a forked child starts its own: two writers on one pipe would interleave)

    def ask(self, request: dict[str, Any], where: str) -> str:
        """The worker's text for `request`, or ChatTemplateError naming `where` (its compile or
        render error, a render past the time or memory a worker has)."""
        line = json.dumps(request, ensure_ascii=True, default=str) + "\n"
        with self._lock:
            answer = self._exchange(line)
        if answer is None:
            raise ChatTemplateError(f"{where}: the chat template failed on these messages: it ran past "
                                    f"{RENDER_TIMEOUT_S:g} s or its worker's {WORKER_MEMORY_BYTES >> 20} MiB")
        if "error" in answer:
            raise ChatTemplateError(f"{where}: {answer['error']}")
        return str(answer["text"])

    def _exchange(self, line: str) -> Optional[dict[str, Any]]:
        process = self._process if self._process is not None and self._process.poll() is None else self._start()
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(line)
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], RENDER_TIMEOUT_S)
            answer = process.stdout.readline() if ready else ""
        except OSError:  # (the worker died between requests: a broken pipe)
            answer = ""
        if not answer:
            self.close()
            return None
        return json.loads(answer)

    def _start(self) -> subprocess.Popen:
        import markupsafe

        # (the folder holding this package, mstar/runtime/serve/ three levels up, and jinja2's and markupsafe's)
        paths = [str(Path(__file__).resolve().parents[3])]
        paths += [str(Path(module.__file__ or "").resolve().parents[1]) for module in (jinja2, markupsafe)]
        code = (f"import sys; sys.path[:0] = {paths!r}; "
                "from mstar.runtime.serve.chat_template import serve_requests; serve_requests()")
        try:
            self._process = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                             encoding="utf-8")
        except OSError as error:
            raise ChatTemplateError(f"the chat template's worker process cannot start: {error}") from None
        return self._process

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


_the_worker: Optional[TemplateWorker] = None
_worker_lock = threading.Lock()


def _worker() -> TemplateWorker:
    global _the_worker
    with _worker_lock:
        if _the_worker is None or _the_worker.owner_pid != os.getpid():
            _the_worker = TemplateWorker()
        return _the_worker


def serve_requests() -> None:
    """The worker's loop: a JSON request a line on stdin ({"compile": source} or {"render": source,
    "variables": {...}}), a JSON answer a line on stdout ({"text": ...} or {"error": ...}); ends
    with stdin (the parent gone)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    compiled: dict[str, Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        source = request.get("render", request.get("compile"))
        try:
            answer = _answer(compiled, source, request.get("variables"))
        except MemoryError:
            answer = {"error": _PAST_MEMORY}
        sys.stdout.write(json.dumps(answer, ensure_ascii=True) + "\n")
        sys.stdout.flush()


def _answer(compiled: dict[str, Any], source: str, variables: Optional[dict[str, Any]]) -> dict[str, Any]:
    template = compiled.get(source)
    if template is None:
        try:
            template = _compiled(source)
        except ChatTemplateError as error:
            return {"error": str(error)}
        compiled.clear()  # (one template a process in practice: keep the last only)
        compiled[source] = template
    if variables is None:
        return {"text": ""}
    try:
        text = template.render(range=_RangeBudget(), **variables)
    except MemoryError:
        return {"error": _PAST_MEMORY}
    except Exception as error:  # a template's own: jinja's, a ZeroDivisionError, a RecursionError, ...
        said = str(error) if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {error}"
        return {"error": f"the chat template failed on these messages: {said}"}
    if len(text) > MAX_TEXT:
        return {"error": f"the chat template failed on these messages: it rendered {len(text)} characters, "
                         f"past the {MAX_TEXT} a prompt may take"}
    return {"text": text}


def _compiled(source: str) -> Any:
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
        return env.from_string(source)
    except MemoryError:  # (Jinja folds constants as it compiles: `'%0999999999d' % 1` allocates there)
        raise ChatTemplateError("chat_template cannot be compiled: MemoryError (past the "
                                f"{WORKER_MEMORY_BYTES >> 20} MiB a worker may take)") from None
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat_template is not a valid template (line {error.lineno}: "
                                f"{error.message})") from None
    except Exception as error:  # (a compile that fails otherwise: a nesting past Python's recursion limit)
        raise ChatTemplateError(f"chat_template cannot be compiled: {type(error).__name__}") from None
