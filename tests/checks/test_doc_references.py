"""What README.md and docs/*.md name exists: files (`serve/host_timeline.py`,
`tests/engine/test_offload.py::test_x`, in code spans and in prose), the flags of `mstar ...` /
`mstarc ...` command lines (checked against each command's argparse parser, built in-process), the
parts of `tools/gpu/checks.sh PART`, and code spans that are a whole name: `Class.attribute`,
`module.name`, `file.py: name`, `snake_case` or `CamelCase`. Code moved over many sessions and the
docs kept naming where it had been.

The docs abbreviate paths (`serve/x.py` is mstar/runtime/serve/x.py, `gpu/y.py` is
mstar/runtime/engine/gpu/y.py), so a path is looked up under each of ROOTS, and a bare file name
anywhere in the repository. Not checked: paths under a git-ignored directory (the `.gpuwork/`
one-off scripts), outside the repository (`../shared/...`), placeholders (`specs/<model>.mw`), the
files of example diagnostics (`bad.mw:3:5: error[...]`), and a name on a line that says it is gone
or replaced (the docs' history keeps such names on purpose). A class's or module's names are the
words of its text, so a name in a comment there counts.
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `fixtures/` is tests/checks/fixtures/ in docs/diagnostics.md (generated from that directory)
ROOTS = [ROOT, ROOT / "mstar", ROOT / "mstar" / "runtime", ROOT / "mstar" / "runtime" / "engine",
         ROOT / "tests" / "checks"]
SOURCE_DIRS = ("mstar", "tests", "tools", "specs", "configs", "grammar", "generated", "docs", "editors")

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")
PATH = re.compile(r"(?<![\w./<>*-])([\w./<>*{}-]*\w\.(?:py|sh|mw|yaml|lark|md))(?:::(\w+))?(?![\w/]|\.\w)")
# `bad.mw:3:5: error[MW004]: ...`: an example diagnostic, its files the example's (some missing on purpose)
DIAGNOSTIC = re.compile(r"^\S+:\d+:\d+: (?:error|warning|note)\b", re.MULTILINE)
COMMAND = re.compile(r"(?<![\w./-])(mstarc?)\s+([a-z][\w-]*)((?:\s+[a-z]+\b)?)")
# a line that says the thing it names is no more: `RequestState.needs_row_path` is gone
GONE = re.compile(r"\b(?:gone|removed|deleted|no longer|retired|renamed|replaced)\b")
FLAG = re.compile(r"(?<!\S)(--[a-z][\w-]*)")
# a command line ends at a shell separator or where another command starts
COMMAND_END = re.compile(r"[|;&]|\b(?:python3?|pytest|torchrun|curl|mstarc?)\s")
CHECKS_PART = re.compile(r"(?<![\w/])(?:tools/gpu/)?checks\.sh\s+([a-z][\w-]*)")
ATTRIBUTE = re.compile(r"^([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*|[a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)(?:\(.*\))?$", re.DOTALL)
WORD = re.compile(r"\w+")
CLASS = re.compile(r"^([ \t]*)class (\w+)(?:\(([^)]*)\))?:.*\n", re.MULTILINE)
FILE_NAME = re.compile(r"^([\w/]+\.py): (\w+)$")
EXTENSIONS = {"py", "md", "sh", "mw", "yaml", "lark", "json", "jsonl", "plan", "png", "wav", "ninja", "j2", "txt"}
EXTERNAL_CLASS = re.compile(r"For[A-Z]\w*$")  # transformers' model classes (`WhisperForConditionalGeneration`)
# a whole span that is one identifier: snake_case with an underscore, or CamelCase with two humps
IDENTIFIER = re.compile(r"^([a-z_][a-z0-9]*_[a-z0-9_]*|[A-Z][a-z0-9]+[A-Z]\w*)(?:\(.*\))?$", re.DOTALL)
# identifiers the docs take from other code: FlashInfer's, fla's, torch's CUDA kernels, transformers',
# the reference implementations' and the standard library's
ELSEWHERE = {"disable_split_kv", "fixed_split_size", "prepare_chunk_indices_static", "direct_copy",
             "vectorized_gather", "condition_on_prev_tokens", "cfg_interval", "prefill_video_mpc", "IncompleteRead",
             "posix_fadvise"}
CODE_SUFFIXES = {".py", ".mw", ".yaml", ".lark", ".sh", ".j2", ".json", ".expected"}
# spans of that shape that name no Python: a plan field's path, a report's value, another package's class
NOT_CODE = {"deployment.kv_pools", "rule_graphs.off", "snac.SNAC"}
PLACEHOLDER = re.compile(r"[<>{}]|(?:^|/)(?:[A-Z]+|x)(?:_\w+)?\.\w+$")
# names the docs give that are deliberately not files of this repository
NOT_IN_REPO = {
    "llama_3_2_1b_instruct", "llama32",  # what the docs' `mstarc init` examples write
    "whisper_large", "pi05_droid",  # the reference implementations' deployments
    "llama_glue_glue",  # what `mstarc compile -o generated/llama_glue.py` used to write
    "source",  # `source.mw`: the TextMate scope of .mw files
    "flashinfer",  # ../shared/reference/flashinfer.md
}
EXTERNAL = ("../", "/", "~", "shared/", "site-packages", "transformers/", "flashinfer/", "fla/", "triton/", "torch/")


def _regions(text: str):
    """(line, code, is_block) for every fenced block and inline code span; a span may wrap onto the
    next line (the wrap is a space: a command goes on), a block's line ends a command without `\\`."""
    for block in FENCE.finditer(text):
        yield text.count("\n", 0, block.start()) + 1, block.group(), True
    prose = FENCE.sub(lambda block: "\n" * block.group().count("\n"), text)
    for span in SPAN.finditer(prose):
        yield prose.count("\n", 0, span.start()) + 1, span.group(1), False


def _prose(text: str) -> str:
    """The text with its code blanked (fenced blocks and spans), lines kept where they were."""
    text = FENCE.sub(lambda block: "\n" * block.group().count("\n"), text)
    return SPAN.sub(lambda span: re.sub(r"[^\n]", " ", span.group()), text)


def _ignored_dirs() -> set[str]:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip("/") for line in lines if line.endswith("/") and "*" not in line}


@cache
def _basenames() -> frozenset[str]:
    return frozenset(path.name for top in SOURCE_DIRS for path in (ROOT / top).rglob("*") if path.is_file())


def _resolve(path: str) -> Path | None:
    for root in ROOTS:
        if "*" in path:
            found = sorted(root.glob(path))
            if found:
                return found[0]
        elif (root / path).is_file():
            return root / path
    return None


def _path_problem(path: str, test: str | None, ignored: set[str]) -> str | None:
    stem = Path(path).stem
    if path.startswith(EXTERNAL) or path.split("/")[0] in ignored or {stem, stem.removesuffix("_glue")} & NOT_IN_REPO:
        return None
    if "/" not in path:
        if any(fnmatch.fnmatch(name, path) for name in _basenames()) or PLACEHOLDER.search(path):
            return None
        return "no file of this name in the repository"
    found = _resolve(path)
    if found is None:
        return None if PLACEHOLDER.search(path) else "no such file (under ., mstar/, mstar/runtime/, its engine/)"
    if test and not re.search(rf"^\s*(?:async )?def {test}\(", found.read_text(), re.MULTILINE):
        return f"{found.relative_to(ROOT)} has no {test}"
    return None


def _catching_parser(main, argv: list[str]) -> argparse.ArgumentParser:
    """The parser a command's main builds, taken at its parse_args (nothing of the command runs)."""
    class Caught(Exception):
        pass

    def catch(parser, *args, **kwargs):
        raise Caught(parser)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", catch)
        try:
            main(argv)
        except Caught as caught:
            return caught.args[0]
    raise AssertionError(f"{main.__module__}.main never parsed its arguments")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


@cache
def _flags(command: tuple[str, ...]) -> frozenset[str] | None:
    """Option strings of `mstar run`, `mstar bench kv`, `mstarc compile`...; None for no such command."""
    from mstar.cli import common, mstar, mstarc

    prog, sub, *rest = command
    if prog == "mstarc":
        parser = _subparser(mstarc.build_parser(), sub)
    elif sub == "serve":
        parser = importlib.import_module("mstar.runtime.serve.server").parser()
    elif sub == "bench" and rest[0]:
        if rest[0] not in mstar.BENCHES:
            return None
        parser = _catching_parser(importlib.import_module(mstar.BENCHES[rest[0]]).main, [])
    else:
        parser = _subparser(mstar._parser(), sub)
    if parser is None:
        return None
    return frozenset(parser._option_string_actions) | frozenset(common.global_parser(prog)._option_string_actions)


def _command_problems(code: str, is_block: bool):
    """(offset, reference, problem) for each flag a `mstar ...` / `mstarc ...` command line does not take."""
    code = code if is_block else code.replace("\n", " ")
    for command in COMMAND.finditer(code):
        prog, sub, what = command.group(1), command.group(2), command.group(3).strip()
        rest = code[command.end():].replace("\\\n", " ").split("\n")[0]
        end = COMMAND_END.search(rest)
        flags_given = FLAG.findall(rest[:end.start()] if end else rest)
        key = (prog, sub, what) if sub == "bench" else (prog, sub)
        flags = _flags(key)
        if flags is None:
            if flags_given:  # (without flags it may be prose: `mstarc stops after 100 syntax errors`)
                yield command.start(), " ".join(key), "no such command"
            continue
        for flag in flags_given:
            if flag not in flags:
                yield command.start(), f"{' '.join(key)} {flag}", "the command takes no such flag"


@cache
def _checks_parts() -> frozenset[str]:
    text = (ROOT / "tools" / "gpu" / "checks.sh").read_text()
    return frozenset(part for parts in re.findall(r"^\s*([a-z][\w|-]*)\)", text, re.MULTILINE)
                     for part in parts.split("|"))


@cache
def _index() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(class name -> the words of its body, with its bases' (by name); module name -> the words
    of every module of that name), over mstar/: by text, not ast (parsing it all took 1.4 s)."""
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    for path in (ROOT / "mstar").rglob("*.py"):
        text = path.read_text()
        modules.setdefault(path.stem, set()).update(WORD.findall(text))
        for match in CLASS.finditer(text):
            indent, name = match.group(1), match.group(2)
            body = re.compile(rf"^(?!{indent}\S)(?:{indent}[ \t].*)?$\n?", re.MULTILINE)
            lines, at = [], match.end()
            while (line := body.match(text, at)) and line.end() > at:
                lines.append(line.group())
                at = line.end()
            own.setdefault(name, set()).update(WORD.findall("".join(lines)))
            bases.setdefault(name, set()).update(WORD.findall(match.group(3) or ""))

    def every(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        names = set(own.get(name, ()))
        for base in bases.get(name, set()) - seen:
            names |= every(base, seen | {name})
        return names

    return {name: every(name) for name in own}, modules


@cache
def _tokens() -> frozenset[str]:
    """Every word of the repository's code, specs, deployments and fixtures."""
    return frozenset(word for top in SOURCE_DIRS if top not in ("docs", "generated")
                     for path in (ROOT / top).rglob("*") if path.suffix in CODE_SUFFIXES and path.is_file()
                     and path != Path(__file__).resolve()  # (this test names missing things on purpose)
                     for word in WORD.findall(path.read_text(errors="replace")))


def _identifier_problem(code: str) -> str | None:
    """`claim_prefix`, `claim_prefix(...)` or `PrefixCache` (the whole span) that no code of the repository names."""
    match = IDENTIFIER.match(code.strip())
    if not match or match.group(1) in ELSEWHERE or EXTERNAL_CLASS.search(match.group(1)):
        return None
    return None if match.group(1) in _tokens() else "no code of the repository names it (another library's? ELSEWHERE)"


def _attribute_problem(code: str) -> str | None:
    """`Class.attribute` or `module.name` (the whole span) that mstar/ does not define."""
    match = ATTRIBUTE.match(code.strip())
    if not match or match.group(2) in EXTENSIONS or code.strip() in NOT_CODE:
        return None
    classes, modules = _index()
    owner, name = match.groups()
    if owner in classes:
        return None if name in classes[owner] else f"class {owner} has no {name}"
    if owner in modules:
        return None if name in modules[owner] else f"no module {owner}.py defines {name}"
    if owner[0].isupper() and not EXTERNAL_CLASS.search(owner):
        return f"mstar/ has no class {owner}"
    return None  # a local name (`args.plan`) or another library's module


def _file_name_problem(code: str) -> str | None:
    """`gpu/runner.py: fast_path_reason` (the whole span) whose file does not define the name."""
    match = FILE_NAME.match(code.strip())
    if not match:
        return None
    path, name = match.groups()
    files = [_resolve(path)] if "/" in path else list((ROOT / "mstar").rglob(path))
    if any(file and name in WORD.findall(file.read_text()) for file in files):
        return None
    return f"{path} does not define {name}"


def _region_problems(code: str, is_block: bool, ignored: set[str]):
    """(offset in the code, reference, problem) for what the code names and is not there."""
    for match in PATH.finditer(code):
        if not DIAGNOSTIC.match(code, code.rfind("\n", 0, match.start()) + 1):
            problem = _path_problem(match.group(1), match.group(2), ignored)
            if problem:
                yield match.start(), match.group(), problem
    for offset, reference, problem in _command_problems(code, is_block):
        yield offset, reference, problem
    for match in CHECKS_PART.finditer(code):
        if match.group(1) not in _checks_parts():
            yield match.start(), match.group(), "tools/gpu/checks.sh has no such part"
    problem = _attribute_problem(code) or _file_name_problem(code) or _identifier_problem(code)
    if problem:
        yield 0, code.strip(), problem


def _problems():
    ignored = _ignored_dirs()
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        lines = text.splitlines()
        found = [(line + code.count("\n", 0, offset), reference, problem)
                 for line, code, is_block in _regions(text)
                 for offset, reference, problem in _region_problems(code, is_block, ignored)]
        for number, prose in enumerate(_prose(text).splitlines(), 1):
            found += [(number, match.group(), problem) for match in PATH.finditer(prose)
                      if (problem := _path_problem(match.group(1), match.group(2), ignored))]
        for number, reference, problem in sorted(found):
            if not GONE.search(lines[number - 1]):
                yield f"{doc.relative_to(ROOT)}:{number} -> `{reference}`: {problem}"


def test_docs_name_code_that_exists():
    problems = list(dict.fromkeys(_problems()))
    assert not problems, "stale references in the docs (doc:line -> reference):\n" + "\n".join(problems)


@pytest.mark.parametrize("code, is_stale", [
    ("serve/host_timeline.py", False), ("serve/nowhere_at_all.py", True), ("nowhere_at_all.py", True),
    ("tests/engine/test_offload.py::test_no_such_test", True), (".gpuwork/one_off.py", False),
    ("mstar bench kv --prefix-rounds 2", False), ("mstar bench kv --no-such-flag", True),
    ("mstar run --plan p --log-level info", False), ("mstar run --plan p --no-such-flag", True),
    ("mstar serve --plan p --port 1", False), ("mstarc compile specs/llama.mw --no-such-flag", True),
    ("mstar bench no_such_bench --iters 2", True), ("tools/gpu/checks.sh no_such_part", True),
    ("PrefixCache.claim_chain", False), ("PrefixCache.no_such_method()", True), ("NoSuchClass.method", True),
    ("glue_packing.no_such_function", True), ("gpu/runner.py: no_such_function", True),
    ("no_such_function_anywhere", True), ("NoSuchClassAnywhere", True), ("claim_chain", False),
])
def test_the_check_finds_what_is_not_there(code, is_stale):
    problems = list(_region_problems(code, False, _ignored_dirs()))
    assert bool(problems) == is_stale, problems
