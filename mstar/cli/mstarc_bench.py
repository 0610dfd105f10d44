"""`mstarc bench`: how long compiling takes, per spec/config pair.

Per pair, each the median of N runs:
- process: wall time of a whole `python -m mstar.cli.mstarc compile SPEC --config C -o TMP`
  process (interpreter start, imports, compile, write). Target: < 0.5 s on a 2-core machine.
  Its CPU time (user + system) is shown beside it: steadier when other work shares the cores.
- own work: `compile_spec` in this process after a warm-up (the compiler's own work, imports
  excluded), with its split per pass. Target: < 50 ms for the largest spec.
Plus two baselines: a bare interpreter start, and interpreter + the compiler's imports, so the
process number can be read as start + imports + own work + writing.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional
from pathlib import Path

from mstar.arg_types import shown_path

PROCESS_TARGET_S = 0.5
OWN_WORK_TARGET_S = 0.050
COMPILER_IMPORTS = "import mstar.cli.mstarc, mstar.compiler.driver, mstar.compiler.glue"


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _child_env() -> dict[str, str]:
    """This process's environment, with the mstar package importable from any directory."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _median_process_seconds(argv: list[str], runs: int, cwd: Path) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) of running `argv` as a process. CPU time is
    the steadier number on a busy machine; wall time is what a user waits."""
    env = _child_env()
    walls, cpus = [], []
    for _ in range(runs):
        cpu_start, start = _children_cpu_seconds(), time.perf_counter()
        subprocess.run(argv, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        cpus.append(_children_cpu_seconds() - cpu_start)
    return statistics.median(walls), statistics.median(cpus)


def measure(root: Path, runs: int) -> dict:
    """Every number of the benchmark as plain data."""
    from mstar.compiler import regen
    from mstar.compiler.driver import compile_spec
    from mstar.lang.diagnostics import Diagnostics

    diags = Diagnostics()
    pairs = regen.config_pairs(root, diags)
    if diags.has_errors:  # configs that do not load, or name no spec: said, not silently left out
        print(diags.render(), file=sys.stderr)
        print("mstarc bench: the configs above are left out", file=sys.stderr)
    python = sys.executable
    report: dict[str, Any] = {
        "runs": runs,
        "python_start_s": _median_process_seconds([python, "-c", "pass"], runs, root)[0],
        "imports_s": _median_process_seconds([python, "-c", COMPILER_IMPORTS], runs, root)[0],
        "pairs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for index, (spec, config) in enumerate(pairs):
            # progress on stderr: the figures come at the end (a minute with the defaults)
            print(f"mstarc bench: {index + 1}/{len(pairs)} {config.stem}", file=sys.stderr, flush=True)
            out = Path(tmp) / f"{config.stem}.plan"
            argv = [python, "-m", "mstar.cli.mstarc", "compile", str(spec), "--config", str(config), "-o", str(out)]
            # warm-up (grammar load, template cache), and pairs with errors are left out
            if compile_spec(spec, config, Diagnostics(), out) is None:
                report["pairs"].append({"config": config.stem, "error": "does not compile"})
                continue
            process_s, process_cpu_s = _median_process_seconds(argv, runs, root)
            totals: list[float] = []
            per_pass: dict[str, list[float]] = {}
            for _ in range(runs):
                start = time.perf_counter()
                result = compile_spec(spec, config, Diagnostics(), out)
                totals.append(time.perf_counter() - start)
                for name, seconds in (result.seconds_per_pass if result else {}).items():
                    per_pass.setdefault(name, []).append(seconds)
            report["pairs"].append({
                "spec": str(spec.relative_to(root)) if spec.is_relative_to(root) else str(spec),
                "config": config.stem,
                "process_s": process_s,
                "process_cpu_s": process_cpu_s,
                "own_work_s": statistics.median(totals),
                "own_work_per_pass_s": {k: statistics.median(v) for k, v in per_pass.items()},
            })
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f}"


def print_report(report: dict) -> None:
    print(f"median of {report['runs']} runs; python start {_ms(report['python_start_s'])} ms, "
          f"python + compiler imports {_ms(report['imports_s'])} ms")
    timed = [pair for pair in report["pairs"] if "error" not in pair]
    passes = sorted({p for pair in timed for p in pair["own_work_per_pass_s"]},
                    key=lambda p: max(pair["own_work_per_pass_s"].get(p, 0) for pair in timed),
                    reverse=True)[:4]
    header = f"{'config':28} {'process ms':>10} {'cpu ms':>8} {'own ms':>8}  " + "  ".join(f"{p:>12}" for p in passes)
    print(header)
    print("-" * len(header))
    for pair in report["pairs"]:
        if "error" in pair:
            print(f"{pair['config']:28} {pair['error']}")
            continue
        cells = "  ".join(f"{_ms(pair['own_work_per_pass_s'].get(p, 0)):>12}" for p in passes)
        is_within = pair["process_s"] < PROCESS_TARGET_S and pair["own_work_s"] < OWN_WORK_TARGET_S
        flag = "" if is_within else "  over target"
        print(f"{pair['config']:28} {_ms(pair['process_s']):>10} {_ms(pair['process_cpu_s']):>8} "
              f"{_ms(pair['own_work_s']):>8}  {cells}{flag}")
    print(f"targets: process < {PROCESS_TARGET_S * 1000:.0f} ms, own work < {OWN_WORK_TARGET_S * 1000:.0f} ms "
          "(per-pass columns: the slowest passes, ms)")


def missing_folders(root: Path) -> Optional[str]:
    """Why `root` is not a repository (its configs/ or specs/ folder missing, named), or None."""
    missing = [name for name in ("configs", "specs") if not (root / name).is_dir()]
    if not missing:
        return None
    return f"mstarc: {shown_path(root)} has no {' and no '.join(f'{name}/' for name in missing)}; run from the " \
           "repository root or pass --root"


def run_bench(root: Path, runs: int, as_json: bool) -> int:
    """runs: at least 1 (the parser's `int_range(1, 1000)` type)."""
    problem = missing_folders(root)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    # absolute: the compile processes run in `root`, so a relative --root's spec paths named nothing
    # there (a CalledProcessError, an internal error)
    report = measure(Path(os.path.abspath(root)), runs)
    if as_json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        print_report(report)
    return 0
