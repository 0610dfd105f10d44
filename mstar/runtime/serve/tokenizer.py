"""A checkpoint directory's tokenizer and chat template: text prompts in, text out.

In: a directory holding `tokenizer.json` (read by the `tokenizers` library) and, optionally,
`tokenizer_config.json` (its `chat_template`, and the special tokens a template may name:
`bos_token`, `eos_token`, ...) and `chat_template.jinja` (the template as transformers 4.50 and later
save it, taking the place of tokenizer_config.json's, as transformers loads it). Out: a `TextTokenizer` with
- `encode(text)`: token ids of a plain text prompt, with the special tokens the tokenizer's
  post-processor adds (a Llama BOS), as transformers' `tokenizer(text)` gives;
- `encode_chat(messages)`: the chat template rendered with `add_generation_prompt=True`, then
  tokenized without adding special tokens (the template writes them), as transformers'
  `apply_chat_template(messages, add_generation_prompt=True)` gives;
- `decode(ids)`: text with special tokens skipped;
- `token_id(token)`: one token's id (a special token a request's start sequence names), or None.

The template is rendered the way transformers renders it (utils/chat_template_utils.py): a
sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, the loop-controls extension,
`raise_exception`, `strftime_now` and a `tojson` filter that does not escape HTML; the special
tokens of tokenizer_config.json are template variables. Only the named templates' default is
used when `chat_template` is a list of named templates.

Which directory (`tokenizer_dir`): `--tokenizer DIR`, else the `--weights` directory of the kv
node whose input takes the text prompt (the plan's `input_roles`: role tokens, prompt text), when
that directory holds tokenizer.json. Failures: `TokenizerError` naming the file and the problem.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from mstar.arg_types import path_problem, shown_path
from mstar.files import MAX_JSON_CONFIG_BYTES, MAX_TOKENIZER_BYTES, InputFileError, read_text_bounded

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
HOW_TO_ADD = ("pass --weights DIR with a checkpoint directory that holds tokenizer.json, "
              "or --tokenizer DIR (a directory with tokenizer.json and, for chat messages, "
              "tokenizer_config.json with a chat_template)")


class TokenizerError(Exception):
    """A tokenizer that cannot be found, read or used (the message names the file)."""


class TextTokenizer:
    """Text <-> token ids through one directory's tokenizer (module docstring)."""

    def __init__(self, directory: str, backend: Any, config: dict[str, Any], template_file: str = CONFIG_FILE):
        self.directory = directory
        self._backend = backend
        self._config = config
        self._template_file = template_file  # the file the chat template came from, for messages
        self._template: Any = None

    def encode(self, text: str) -> list[int]:
        return self._ids(text, add_special_tokens=True)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """Through `encode_batch`, which lets go of the GIL while it works (`encode` holds it: a
        30 MB prompt held every other thread of the server, the run loop's among them, for 20 s)."""
        return list(self._backend.encode_batch([_unicode(text)], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (a token that holds only part of a
        character's bytes reads as U+FFFD)."""
        return self._backend.decode([token], skip_special_tokens=False)

    def token_id(self, token: str) -> Optional[int]:
        """The id of one token of the vocabulary (a special token such as `<|en|>`), else None."""
        found = self._backend.token_to_id(token)
        return int(found) if found is not None else None

    @property
    def has_chat_template(self) -> bool:
        return _chat_template(self._config) is not None

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The chat template's text for `messages`, ending with the assistant's turn opened."""
        from mstar.runtime.serve.chat_template import ChatTemplateError

        template = self._compiled()
        variables = {key: _token_text(value) for key, value in self._config.items()
                     if key.endswith("_token") and _token_text(value) is not None}
        try:
            return template.render(messages=messages, add_generation_prompt=True, **variables)
        except ChatTemplateError as error:
            raise TokenizerError(str(error)) from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._ids(self.render_chat(messages), add_special_tokens=False)

    def _config_path(self) -> str:
        return shown_path(Path(self.directory) / self._template_file)  # for messages: clipped

    def _compiled(self) -> Any:
        if self._template is None:
            source = _chat_template(self._config)
            if source is None:
                raise TokenizerError(f"{self._config_path()}: no chat_template (nor a {TEMPLATE_FILE} beside it), "
                                     "so 'messages' cannot be rendered; give the prompt as 'prompt' text or "
                                     "'prompt_tokens'")
            from mstar.runtime.serve.chat_template import ChatTemplateError, compile_template

            try:
                self._template = compile_template(source, self._config_path())
            except ChatTemplateError as error:
                raise TokenizerError(str(error)) from None
        return self._template


def _unicode(text: str) -> str:
    """`text` when it is valid Unicode; a JSON string may hold a lone surrogate ("\\ud800"), which
    the tokenizer's backend refuses with a bare TypeError: a TokenizerError saying where instead."""
    problem = unicode_problem(text)
    if problem is not None:
        raise TokenizerError(f"the text is not valid Unicode: {problem}")
    return text


def unicode_problem(text: str) -> Optional[str]:
    """Where `text` is not valid Unicode ("surrogates not allowed at character 3"), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"{error.reason} at character {error.start}"
    return None


def _token_text(value: Any) -> Optional[str]:
    """A special token of tokenizer_config.json: a string, or an AddedToken object's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(config: dict[str, Any]) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def has_tokenizer(directory: str) -> bool:
    """os.path.isfile, not Path.is_file: False for a path the OS cannot name, where Path.is_file
    raised ENAMETOOLONG (`tokenizer_dir` refuses such an override with a TokenizerError first)."""
    return os.path.isfile(os.path.join(directory, "tokenizer.json"))


def load_tokenizer(directory: str) -> TextTokenizer:
    """The tokenizer of `directory` (tokenizer.json, tokenizer_config.json if present)."""
    path = Path(directory) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("text prompts need the 'tokenizers' package (pip install tokenizers)") from None
    try:
        text = read_text_bounded(path, max_bytes=MAX_TOKENIZER_BYTES, what="tokenizer")
    except InputFileError as error:
        raise TokenizerError(f"cannot read {error}") from None
    try:
        backend = Tokenizer.from_str(text)
    except Exception as error:  # the Rust side raises its own exception type
        raise TokenizerError(f"tokenizer {shown_path(path)}: not a tokenizer.json the tokenizers library reads "
                             f"({error})") from None
    config = _read_config(Path(directory) / CONFIG_FILE)
    template_path = Path(directory) / TEMPLATE_FILE
    if not os.path.exists(template_path):
        return TextTokenizer(str(directory), backend, config)
    # transformers (4.50 on) saves the template here and not in tokenizer_config.json; when both hold one,
    # transformers renders this file's, so it wins here too
    try:
        template = read_text_bounded(template_path, max_bytes=MAX_JSON_CONFIG_BYTES, what="chat template")
    except InputFileError as error:
        raise TokenizerError(f"cannot read {error}") from None
    return TextTokenizer(str(directory), backend, {**config, "chat_template": template}, TEMPLATE_FILE)


def _read_config(config_path: Path) -> dict[str, Any]:
    """tokenizer_config.json's object, or {} where the directory has none."""
    if not os.path.exists(config_path):  # (Path.exists raised past PATH_MAX, 7 bytes beyond tokenizer.json's)
        return {}
    try:
        config = json.loads(read_text_bounded(config_path, max_bytes=MAX_JSON_CONFIG_BYTES, what="tokenizer config"))
    except InputFileError as error:
        raise TokenizerError(f"cannot read {error}") from None
    except ValueError as error:
        raise TokenizerError(f"tokenizer config {shown_path(config_path)}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"tokenizer config {shown_path(config_path)}: expected a JSON object")
    return config


def text_prompt_nodes(plan: Any) -> list[str]:
    """The kv nodes of the plan whose input takes the request's text prompt, in plan order."""
    return [node.name for node in plan.nodes if node.engine == "kv"
            and any(i.prompt == "text" and i.role == "tokens" for i in node.input_roles)]


def tokenizer_dir(plan: Any, checkpoints: dict[str, str], override: Optional[str]) -> Optional[str]:
    """The directory to read the tokenizer from, or None when there is none (module docstring).
    `checkpoints`: {node: directory} from the `--weights` entries."""
    for directory in checkpoints.values():  # checked here for the sim engine too, which reads no weights:
        if not os.path.isdir(directory):  # a mistyped --weights there went unnoticed, exit 0, no text
            what = "is not a directory" if os.path.exists(directory) else "no such directory"
            raise TokenizerError(f"--weights {shown_path(directory)}: {what} (expected a checkpoint directory)")
    if override is not None:
        problem = path_problem(override)
        if problem is not None:  # a path the OS cannot name: has_tokenizer would call it empty
            raise TokenizerError(f"--tokenizer {problem}")
        if not has_tokenizer(override):
            raise TokenizerError(f"--tokenizer {shown_path(override)}: no tokenizer.json in that directory")
        return override
    found = {checkpoints[name] for name in text_prompt_nodes(plan)
             if name in checkpoints and has_tokenizer(checkpoints[name])}
    if len(found) > 1:
        raise TokenizerError(f"the checkpoints of several text prompt nodes hold a tokenizer "
                             f"({', '.join(map(shown_path, sorted(found)))}); "
                             "choose one with --tokenizer DIR")
    return found.pop() if found else None


# Stop strings a request may give, and their length: each step of a request looks for each of its
# stop strings in its new text, on the run loop every request shares (an audit's request of 60,000
# stop strings took an unrelated request from 7 ms to 0.5-0.7 s). OpenAI's API takes 4.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


def stop_strings_problem(stops: Sequence[str]) -> Optional[str]:
    """Why these stop strings are refused (too many, one too long), or None."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}"
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        return f"stop strings may be at most {MAX_STOP_CHARS} characters long, got one of {longest}"
    for index, stop in enumerate(stops):  # a lone surrogate ("\ud800") is in no decoded text: it never matched
        problem = unicode_problem(stop)
        if problem is not None:
            return f"stop string {index} is not valid Unicode: {problem}"
    return None


def stop_text_index(text: str, stops: Sequence[str], start: int = 0, after: int = 0) -> Optional[int]:
    """Where the earliest of the stop strings starts in `text` at or after `start`, or None; only
    an occurrence that ends past character `after` counts (min_tokens: the text of a request's
    first min_tokens tokens holds no stop, as vLLM's)."""
    found = [index for index in (text.find(s, max(start, after - len(s) + 1)) for s in stops) if index >= 0]
    return min(found) if found else None
