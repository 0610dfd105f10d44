"""Options every mstar command takes: `--log-level` and `--version`.

    rest = take_global_options(argv, "mstar")   # sets up logging, or prints the version and exits

The options are taken out of the argument list wherever they stand (`mstar --log-level info run
...` and `mstar run ... --log-level info` both work) before the command's own parser sees it, so
subcommands that parse their own arguments (`mstar bench serve`) get them too. Logging is the
standard library's: every module logs to `logging.getLogger(__name__)` under the `mstar` logger,
which this sets to the level asked for (default warning) with one handler writing
`LEVEL logger: message` lines to stderr.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def version_line(prog: str) -> str:
    """`PROG VERSION (plan schema N)`: the installed package's version, and the plan format it reads."""
    from importlib.metadata import PackageNotFoundError, version

    from mstar.plan.schema import COMPILER_VERSION, SCHEMA_VERSION

    try:
        package = version("mstar")
    except PackageNotFoundError:  # run from a checkout without installing
        package = f"{COMPILER_VERSION} (not installed)"
    return f"{prog} {package} (compiler {COMPILER_VERSION}, plan schema {SCHEMA_VERSION})"


class _Version(argparse.Action):
    """--version, with the line built only when asked for (it imports the plan schema)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_line(parser.prog))
        parser.exit()


def global_parser(prog: str) -> argparse.ArgumentParser:
    """The shared options, as a parent parser (for the commands' --help) and for taking them out."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                        help="log messages at this level and above to stderr (default warning)")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    return parser


def setup_logging(level: str) -> None:
    logger = logging.getLogger("mstar")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def take_global_options(argv: Sequence[str], prog: str, own_log_level: Sequence[str] = ()) -> list[str]:
    """argv less --log-level and --version; logging set up (argparse exits 0 for --version and 2
    for a bad level). A command named in `own_log_level` (one that also hands the level to a
    library of its own, as a server does to its HTTP stack) gets an explicit --log-level back."""
    options, rest = global_parser(prog).parse_known_args(list(argv))
    setup_logging(options.log_level or "warning")
    if options.log_level and rest[:1] and rest[0] in own_log_level:
        rest += ["--log-level", options.log_level]
    return rest
