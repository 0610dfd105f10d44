"""mstarc: the compiler's command line.

    mstarc compile SPEC [--config FILE] [-o PLAN]   spec + deployment -> plan + glue
    mstarc init --from-checkpoint DIR [--codec-checkpoint DIR] [--name NAME] [-o SPEC]
                [--config-out FILE] [--plan-out PLAN] [--force]
                                                    a spec and deployment from config.json, compiled
    mstarc check SPEC [--config FILE]               passes 1-5 only, writes nothing
    mstarc explain PLAN [--no-verify]               the plan's tables, readable
    mstarc fmt SPEC [--check | --write]             canonical spec text
    mstarc regen [--check] [--root DIR]             rebuild (or check) all of generated/
    mstarc graph SPEC -o FILE.svg                   draw the walks and the streams between partitions
    mstarc schema [-o FILE]                         the deployment file's JSON Schema
    mstarc bench [--json] [--runs N] [--root DIR]   compile-time benchmark per spec

Exit status: 0 ok, 1 errors in the input (diagnostics on stderr), 2 usage. No input file,
however broken, gives a traceback. Heavy libraries (rich, matplotlib, jinja2) are imported only
by the commands that need them, and torch never.
"""
from __future__ import annotations

import argparse
import codecs
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from mstar.arg_types import int_range, os_error_text, path_arg, shown, shown_error, shown_path
from mstar.files import make_dirs
from mstar.cli.common import global_parser, take_global_options

EXIT_OK, EXIT_INPUT, EXIT_USAGE = 0, 1, 2


def _report(diags) -> None:
    text = diags.render()
    sys.stderr.write(text)
    num_errors = sum(d.severity == "error" for d in diags.items)
    if num_errors:
        sys.stderr.write(f"mstarc: {num_errors} error{'s' if num_errors != 1 else ''}\n")


def _write_problem(target, error: OSError) -> str:
    """`mstarc: cannot write TARGET: why`, naming the path that failed when it is not TARGET
    (a parent directory that could not be made because a file has its name, say)."""
    why = error.strerror or shown_path(str(error))
    failed = error.filename
    if isinstance(error, FileExistsError) and failed:
        why = f"{shown_path(failed)} exists and is not a directory"
    elif failed and str(failed) != str(target):
        why = f"{why}: {shown_path(failed)}"
    return f"mstarc: cannot write {shown_path(target)}: {why}\n"


def _plan_path_problem(option: str, output: Optional[str]) -> Optional[str]:
    """Why `output` (given to `option`) cannot be where a plan goes, or None. A plan's path ends in
    .plan, or names an existing directory (the default name goes inside): the glue is written
    beside it as STEM_glue.py, so `-o generated/llama_glue.py` wrote a plan over llama's glue and
    then a llama_glue_glue.py, and `-o x.txt` a plan that `mstarc regen` never sees. (An empty
    one is path_arg's to refuse.)"""
    if output is None or output.endswith(".plan") or Path(output).is_dir():
        return None
    return (f"mstarc: {option} {shown_path(output)} does not end in .plan; a plan's path is NAME.plan (its glue is "
            "written beside it as NAME_glue.py) or an existing directory\n")


def _replaces_input(outputs: list[tuple[str, object]], inputs: list[tuple[str, object]]) -> Optional[str]:
    """Why writing one of `outputs` (what, path) would replace one of the `inputs` (what, path),
    or None: `mstarc compile x.plan -o x.plan` wrote the plan over its own spec, `graph -o s.svg
    s.svg` the picture over the spec, and exited 0."""
    for out_what, out in outputs:
        for in_what, source in inputs:
            if source is not None and _is_same_file(str(out), str(source)):
                return (f"mstarc: {out_what} {shown_path(out)} is the {in_what}: writing it would replace that input; "
                        "choose another path\n")
    return None


def _is_same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # a hard link or a symlink to it counts
    except OSError:  # one does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def cmd_compile(args) -> int:
    from mstar.compiler.driver import compile_spec
    from mstar.compiler.emit import write_outputs
    from mstar.lang.diagnostics import Diagnostics

    problem = _plan_path_problem("-o", args.output)
    if problem is not None:
        sys.stderr.write(problem)
        return EXIT_USAGE
    diags = Diagnostics()
    result = compile_spec(args.spec, args.config, diags, args.output)
    _report(diags)
    if result is None:
        return EXIT_INPUT
    problem = _replaces_input([("the plan", result.plan_path), ("its glue", result.glue_path)],
                              [("spec", args.spec), ("deployment", args.config)])
    if problem is not None:
        sys.stderr.write(problem)
        return EXIT_USAGE
    try:
        write_outputs(result.plan_path, result.plan_text, result.glue_path, result.glue_text)
    except OSError as e:
        sys.stderr.write(_write_problem(result.plan_path, e))
        return EXIT_INPUT
    print(f"wrote {result.plan_path} and {result.glue_path}")
    return EXIT_OK


def cmd_init(args) -> int:
    """Write a spec and a deployment for a checkpoint (compiler/from_checkpoint.py), then compile them."""
    from mstar.compiler.from_checkpoint import MAX_MODEL_NAME_CHARS, InitError, model_name, read_checkpoint
    from mstar.files import atomic_write_many

    # `--name ""` is refused below, not taken for no --name
    name = args.name if args.name is not None else model_name(Path(args.from_checkpoint).resolve().name)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        sys.stderr.write(f"mstarc: --name {shown(name)}: a model name is letters, digits and _, not starting with a "
                         "digit\n")
        return EXIT_USAGE
    if len(name) > MAX_MODEL_NAME_CHARS:  # it names the default files: past a file name's length the writes failed
        sys.stderr.write(f"mstarc: --name {shown(name)}: a model name is at most {MAX_MODEL_NAME_CHARS} characters\n")
        return EXIT_USAGE
    problem = _plan_path_problem("--plan-out", args.plan_out)
    if problem is not None:  # before anything is written
        sys.stderr.write(problem)
        return EXIT_USAGE
    spec_path = Path(args.output or f"specs/{name}.mw")
    config_path = Path(args.config_out or f"configs/{name}.yaml")
    outputs = [spec_path.resolve(), config_path.resolve()] + ([Path(args.plan_out).resolve()] if args.plan_out else [])
    if len(set(outputs)) < len(outputs):
        sys.stderr.write("mstarc: the spec, the deployment and the plan need three different paths "
                         "(-o, --config-out, --plan-out)\n")
        return EXIT_USAGE
    problem = _inside_checkpoint([spec_path, config_path] + ([Path(args.plan_out)] if args.plan_out else []),
                                 [args.from_checkpoint, args.codec_checkpoint])
    if problem is not None:  # even with --force: init reads those files
        sys.stderr.write(problem)
        return EXIT_USAGE
    existing = [str(p) for p in (spec_path, config_path) if p.exists()]
    if existing and not args.force:
        verb = "already exists" if len(existing) == 1 else "already exist"
        sys.stderr.write(f"mstarc: {' and '.join(map(shown_path, existing))} {verb}; pass --force to replace\n")
        return EXIT_INPUT
    try:
        if args.codec_checkpoint is not None:
            from mstar.compiler.from_tts_checkpoint import read_tts_checkpoints

            files = read_tts_checkpoints(args.from_checkpoint, args.codec_checkpoint, name)
        else:
            files = read_checkpoint(args.from_checkpoint, name)
    except InitError as e:
        sys.stderr.write(f"mstarc: {e}\n")
        return EXIT_INPUT
    previous = {path: path.read_bytes() if path.is_file() else None for path in (spec_path, config_path)}
    try:
        for path in (spec_path, config_path):
            make_dirs(path.parent)
        atomic_write_many([(spec_path, files.spec.encode("utf-8")), (config_path, files.deployment.encode("utf-8"))])
    except OSError as e:
        sys.stderr.write(_write_problem(e.filename or spec_path, e))
        return EXIT_INPUT
    print(f"wrote {spec_path} and {config_path} ({files.architecture})")
    status = cmd_compile(argparse.Namespace(spec=str(spec_path), config=str(config_path), output=args.plan_out))
    if status != EXIT_OK:  # values the compiler refuses (a size past its limits): leave nothing behind
        _restore(previous)
        sys.stderr.write(f"mstarc: {shown_path(args.from_checkpoint)}: the spec and deployment written from it do "
                         f"not compile (above); {_undone(previous)}\n")
    return status


def _undone(previous: dict[Path, Optional[bytes]]) -> str:
    """What `_restore` did, file by file: one that was there is restored, a new one removed (the
    message said "X and Y were restored" when only one of them had been there)."""
    def said(paths: list[Path], verb: str) -> str:
        return f"{' and '.join(map(shown_path, paths))} {'was' if len(paths) == 1 else 'were'} {verb}"

    restored = [path for path, data in previous.items() if data is not None]
    removed = [path for path, data in previous.items() if data is None]
    return "; ".join(said(paths, verb) for paths, verb in ((restored, "restored"), (removed, "removed")) if paths)


def _inside_checkpoint(outputs: list[Path], checkpoints: list[Optional[str]]) -> Optional[str]:
    """Why init would write over a file of a checkpoint it reads, or None (`--config-out
    CK/config.json --force` replaced the checkpoint's own config.json with the deployment, and the
    next init from there failed). Files of init's own kinds (a spec, a deployment, a plan) may be
    replaced there with --force."""
    for output in outputs:
        if not output.is_file() or output.suffix in (".mw", ".yaml", ".yml", ".plan"):
            continue
        for checkpoint in filter(None, checkpoints):
            if Path(checkpoint).is_dir() and _is_same_file(str(output.resolve().parent), checkpoint):
                return (f"mstarc: {shown_path(output)} is a file of the checkpoint {shown_path(checkpoint)}, which "
                        "init reads; write the spec, deployment and plan elsewhere\n")
    return None


def _restore(previous: dict[Path, Optional[bytes]]) -> None:
    """Put each file back as it was before init wrote it (gone when it did not exist)."""
    from mstar.files import atomic_write_many

    for path, data in previous.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write_many([(path, data)])


def cmd_check(args) -> int:
    from mstar.compiler.driver import check_spec
    from mstar.lang.diagnostics import Diagnostics

    diags = Diagnostics()
    checked = check_spec(args.spec, args.config, diags)
    _report(diags)
    if checked is None:
        return EXIT_INPUT
    print(f"{args.spec} with {checked.config_path}: ok")
    return EXIT_OK


def cmd_explain(args) -> int:
    from rich.console import Console

    from mstar.plan.explain import print_plan
    from mstar.plan.io import PlanError, load_plan

    try:
        plan = load_plan(args.plan, verify=not args.no_verify)
    except PlanError as e:
        sys.stderr.write(f"mstarc: {e}\n")
        return EXIT_INPUT
    class _PipeConsole(Console):
        def on_broken_pipe(self) -> None:  # rich exits 1 when the reader goes away; main ends quietly, 0
            raise BrokenPipeError

    print_plan(plan, _PipeConsole())
    return EXIT_OK


def cmd_fmt(args) -> int:
    from mstar.files import MAX_SPEC_BYTES, InputFileError, atomic_write_text, read_bytes_bounded
    from mstar.lang.diagnostics import Diagnostics
    from mstar.lang.fmt import format_spec
    from mstar.lang.parser import parse

    diags = Diagnostics()
    path = Path(args.spec)
    try:
        raw = read_bytes_bounded(path, max_bytes=MAX_SPEC_BYTES, what="spec")
        text = raw.decode("utf-8-sig")
    except InputFileError as e:
        sys.stderr.write(f"mstarc: cannot read {e}\n")
        return EXIT_INPUT
    except UnicodeDecodeError as e:
        sys.stderr.write(f"mstarc: spec {shown_path(path)} is not UTF-8 text (byte {e.start})\n")
        return EXIT_INPUT
    spec = parse(text, str(path), diags)
    if spec is None or diags.has_errors:
        _report(diags)
        return EXIT_INPUT
    formatted = format_spec(spec)
    if raw.startswith(codecs.BOM_UTF8):  # the canonical form has none: `--check` passed it, `--write` kept it
        text = "\ufeff" + text
    if args.check:
        if formatted != text:
            sys.stderr.write(f"mstarc: {shown_path(path)} is not in canonical form (run mstarc fmt --write "
                             f"{shown_path(path)})\n")
            return EXIT_INPUT
        return EXIT_OK
    if args.write:
        if formatted != text:
            try:
                atomic_write_text(path, formatted)
            except OSError as e:
                sys.stderr.write(_write_problem(path, e))
                return EXIT_INPUT
            print(f"formatted {path}")
        return EXIT_OK
    sys.stdout.write(formatted)
    return EXIT_OK


def cmd_regen(args) -> int:
    from mstar.compiler import regen
    from mstar.lang.diagnostics import Diagnostics

    from mstar.cli.mstarc_bench import missing_folders

    root = Path(args.root)
    problem = missing_folders(root)
    if problem is not None:
        sys.stderr.write(problem + "\n")
        return EXIT_INPUT
    diags = Diagnostics()
    expected = regen.expected_outputs(root, diags)
    _report(diags)
    if diags.has_errors:
        return EXIT_INPUT
    if args.check:
        stale = regen.stale_files(root, expected)
        for item in stale:
            sys.stderr.write(f"stale: {item.path} ({item.reason})\n")
        if stale:
            sys.stderr.write("mstarc: generated/ is out of date; run `mstarc regen`\n")
            return EXIT_INPUT
        print(f"generated/ is up to date ({len(expected)} files)")
        return EXIT_OK
    try:
        changed = regen.write(root, expected)
    except OSError as e:
        sys.stderr.write(_write_problem(e.filename or root / "generated", e))
        return EXIT_INPUT
    for item in changed:
        print(f"{'removed' if item.reason == 'orphan' else 'wrote'} {item.path}")
    print(f"generated/: {len(expected)} files, {len(changed)} changed")
    return EXIT_OK


def cmd_graph(args) -> int:
    if not args.output.lower().endswith(".svg"):  # Path(".svg").suffix is "" (a dot file)
        # The picture is SVG text written directly; a .png (or any other) name would hold SVG.
        sys.stderr.write(f"mstarc: graph writes SVG only, and -o {shown_path(args.output)} does not end in .svg; "
                         "give a .svg name (convert it afterwards for a PNG, e.g. `rsvg-convert -o x.png x.svg`)\n")
        return EXIT_USAGE
    problem = _replaces_input([("-o", args.output)], [("spec", args.spec)])
    if problem is not None:
        sys.stderr.write(problem)
        return EXIT_USAGE
    from mstar.compiler.driver import load_checked_spec
    from mstar.lang.diagnostics import Diagnostics

    diags = Diagnostics()
    spec = load_checked_spec(args.spec, diags)
    _report(diags)
    if spec is None:
        return EXIT_INPUT
    from mstar.compiler.graph_picture import draw_walks

    try:
        draw_walks(spec, Path(args.output))
    except OSError as e:
        sys.stderr.write(_write_problem(args.output, e))
        return EXIT_INPUT
    print(f"wrote {args.output}")
    return EXIT_OK


def cmd_schema(args) -> int:
    import json

    from mstar.compiler.deployment_schema import deployment_schema
    from mstar.files import atomic_write_text

    text = json.dumps(deployment_schema(), indent=2, sort_keys=True) + "\n"
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        make_dirs(Path(args.output).parent)  # as graph and compile create theirs
        atomic_write_text(Path(args.output), text)
    except OSError as e:
        sys.stderr.write(_write_problem(args.output, e))
        return EXIT_INPUT
    print(f"wrote {args.output}")
    return EXIT_OK


def cmd_bench(args) -> int:
    from mstar.cli.mstarc_bench import run_bench

    return run_bench(Path(args.root), args.runs, args.json)


def _add_init(sub: "argparse._SubParsersAction") -> None:
    """`mstarc init`: the longest option list of the commands, apart from the table of the rest."""
    p = sub.add_parser("init", help="write a spec and a deployment from a checkpoint's config.json, then compile")
    p.add_argument("--from-checkpoint", required=True, metavar="DIR", type=path_arg,
                   help="a Hugging Face checkpoint directory (config.json)")
    p.add_argument("--codec-checkpoint", metavar="DIR", type=path_arg,
                   help="a SNAC checkpoint directory: write a TTS spec (Orpheus: the decoder's audio tokens "
                        "through the codec) instead of a text decoder's")
    p.add_argument("--name", help="model name (default: the directory's name as an identifier)")
    p.add_argument("-o", "--output", metavar="SPEC", type=path_arg, help="spec path (default specs/NAME.mw)")
    p.add_argument("--config-out", metavar="FILE", type=path_arg, help="deployment path (default configs/NAME.yaml)")
    p.add_argument("--plan-out", metavar="PLAN", type=path_arg,
                   help="plan path (default as mstarc compile: generated/NAME.plan beside the spec's directory)")
    p.add_argument("--force", action="store_true", help="replace an existing spec or deployment")
    p.set_defaults(run=cmd_init)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstarc", description="Compile .mw walk-graph specs into plans.",
                                     parents=[global_parser("mstarc")])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="compile a spec against a deployment into a plan and its glue")
    p.add_argument("spec", metavar="SPEC", type=path_arg)
    p.add_argument("--config", metavar="FILE", type=path_arg, help="deployment YAML (default configs/<model>.yaml)")
    p.add_argument("-o", "--output", metavar="PLAN", type=path_arg, help="plan path, NAME.plan or a directory (default "
                                                           "generated/<config>.plan); the glue goes beside it")
    p.set_defaults(run=cmd_compile)

    _add_init(sub)

    p = sub.add_parser("check", help="run every check, write nothing")
    p.add_argument("spec", metavar="SPEC", type=path_arg)
    p.add_argument("--config", metavar="FILE", type=path_arg, help="deployment YAML (default configs/<model>.yaml)")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("explain", help="print a plan's tables")
    p.add_argument("plan", metavar="PLAN", type=path_arg)
    p.add_argument("--no-verify", action="store_true", help="do not re-hash the spec, deployment and glue")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("fmt", help="print a spec in canonical form")
    p.add_argument("spec", metavar="SPEC", type=path_arg)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when the file is not canonical")
    mode.add_argument("--write", action="store_true", help="rewrite the file in canonical form")
    p.set_defaults(run=cmd_fmt)

    p = sub.add_parser("regen", help="rebuild generated/ from every configs/*.yaml")
    p.add_argument("--check", action="store_true", help="exit 1 listing stale files, write nothing")
    p.add_argument("--root", default=".", metavar="DIR", type=path_arg, help="repository root (default .)")
    p.set_defaults(run=cmd_regen)

    p = sub.add_parser("schema", help="print the deployment file's JSON Schema (from its pydantic model)")
    p.add_argument("-o", "--output", metavar="FILE", type=path_arg, help="write it to FILE instead of stdout")
    p.set_defaults(run=cmd_schema)

    p = sub.add_parser("graph", help="draw a spec's walks and the streams between its partitions as SVG")
    p.add_argument("spec", metavar="SPEC", type=path_arg)
    p.add_argument("-o", "--output", required=True, metavar="FILE.svg", type=path_arg)
    p.set_defaults(run=cmd_graph)

    p = sub.add_parser("bench", help="compile time per spec (whole process and in-process work)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--runs", type=int_range(1, 1000), default=5, metavar="N", help="runs per measurement (median)")
    p.add_argument("--root", default=".", metavar="DIR", type=path_arg, help="repository root (default .)")
    p.set_defaults(run=cmd_bench)
    return parser


EXIT_INTERRUPTED = 128 + signal.SIGINT


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(take_global_options(sys.argv[1:] if argv is None else argv, "mstarc"))
    interrupts: list[int] = []
    previous = _note_interrupts(interrupts)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say, to anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_OK
    except OSError as e:  # the file system refused a command's read or write the command did not word itself
        if interrupts:
            return _interrupted()
        sys.stderr.write(f"mstarc: {os_error_text(e)}\n")  # str(e) held "[Errno N]" and the whole file name
        return EXIT_INPUT
    except Exception as e:  # a bug in mstarc, not in the input: say so without a traceback
        if interrupts:  # a Ctrl-C inside a library's import (pydantic building a schema) surfaced as its error
            return _interrupted()
        if os.environ.get("MSTARC_TRACEBACK"):
            raise
        sys.stderr.write(
            f"mstarc: internal error ({shown_error(e)}); this is a bug in mstarc, not in "
            "your input. Set MSTARC_TRACEBACK=1 to see where.\n"
        )
        return EXIT_INPUT
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _note_interrupts(interrupts: list[int]) -> Any:
    """Python's own Ctrl-C (KeyboardInterrupt), noted: a command's imports run inside `main`, and
    an interrupt there could come out as an import's error (exit 1, "internal error") or end the
    command silently with exit 1. The handler before, or None off the main thread."""
    def on_interrupt(signum: int, frame: Any) -> None:
        interrupts.append(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    return signal.signal(signal.SIGINT, on_interrupt)


def _interrupted() -> int:
    sys.stderr.write("mstarc: interrupted; a file it writes is replaced whole or not at all\n")
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
