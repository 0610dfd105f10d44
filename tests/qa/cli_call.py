"""One in-process CLI call for the bad-input tests: `main(argv)` with argparse's exits caught."""
from __future__ import annotations


def call_main(main, argv, capsys) -> tuple[int, str]:
    """(exit status, stdout + stderr) of one in-process CLI call."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as stop:  # argparse usage errors
        status = stop.code
    captured = capsys.readouterr()
    return status, captured.out + captured.err
