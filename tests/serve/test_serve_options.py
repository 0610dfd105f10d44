"""`mstar serve`'s option checks that argparse makes: bad usage is its usage line, one error line
and exit status 2, before any plan is loaded."""
from __future__ import annotations

import pytest

from mstar.cli.mstar import main as mstar_main
from mstar.runtime.serve import server
from serve_harness import LLAMA


@pytest.mark.parametrize("name", ["", "   ", "\t"])
def test_an_empty_model_name_is_a_usage_error(capsys, name):
    """It was taken as no --model: the server went on serving the plan's name."""
    for main, argv in ((server.main, ["--plan", LLAMA, "--model", name]),
                       (mstar_main, ["serve", "--plan", LLAMA, "--model", name])):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and "Traceback" not in err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert lines == [f"mstar serve: error: argument --model: must be a non-empty model name, got {name!r}"]


def test_a_model_name_is_kept_as_given():
    assert server.parser().parse_args(["--plan", LLAMA, "--model", "meta-llama/Llama-3.2-1B"]).model == \
        "meta-llama/Llama-3.2-1B"
    assert server.parser().parse_args(["--plan", LLAMA]).model is None  # the plan's name (server.build)


@pytest.mark.parametrize("option", ["--plan", "--tokenizer", "--weights"])
def test_an_empty_path_is_a_usage_error(capsys, option):
    """`Path("")` is the working directory: `--plan ""` said "cannot read plan ." (exit 1), and an
    empty --tokenizer or --weights (an unset shell variable) failed with exit 1 after the plan loaded."""
    for main, argv in ((server.main, ["--plan", LLAMA, option, ""]),
                       (mstar_main, ["serve", "--plan", LLAMA, option, ""])):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and "Traceback" not in err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert lines == [f"mstar serve: error: argument {option}: needs a path, got an empty one"]
