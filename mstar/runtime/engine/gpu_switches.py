"""The process-wide GPU switches `mstar run` and `mstar serve` take alike, and every rank process of
`mstar run` is handed (serve/ranks/worker.py `RankOptions`): `--no-blas-pdl` (ordinary edges into
cuBLAS's products in the CUDA graphs, engine/gpu/blas_edges.py), `--nucleus` (how the device
sampler finds a nucleus, engine/gpu/sampler.py NUCLEUS) and `--penalties` (torch ops or Triton
kernels, engine/gpu/penalties.py PENALTIES). Each is about the torch engine on a GPU, refused
elsewhere, and set before the engine is built (its graphs are captured then).

Importing this module imports no torch: the options are parsed and checked before the engine's
modules load (`apply` loads them).
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

NUCLEUS_CHOICES = ("sort", "search")
PENALTIES_CHOICES = ("torch", "kernels")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-blas-pdl", action="store_true",
                        help="torch engine on a GPU: keep the CUDA graphs' edges into cuBLAS's sm_90 products "
                             "ordinary (default: programmatic, docs/engine.md \"Programmatic edges into cuBLAS\"; "
                             "this turns that off if a cuBLAS upgrade breaks what it relies on)")
    parser.add_argument("--nucleus", choices=NUCLEUS_CHOICES,
                        help="torch engine on a GPU: how the device sampler finds a top_p or top_k nucleus: "
                             "the Triton kernels' search (default) or torch's sort of each row's vocabulary "
                             "(docs/engine.md \"A nucleus without the sort\")")
    parser.add_argument("--penalties", choices=PENALTIES_CHOICES,
                        help="torch engine on a GPU: how the repetition, presence and frequency penalties are "
                             "applied: two Triton kernels (default) or torch ops (docs/engine.md \"Penalties "
                             "from a device table\")")


def off_gpu_problem(args: Any, is_on_gpu: bool) -> Optional[str]:
    """Why the switches given cannot apply (the first given, where the run is not on a GPU); None
    when they can."""
    if is_on_gpu:
        return None
    if args.no_blas_pdl:
        return "--no-blas-pdl is about the GPU's CUDA graphs: it needs --engine torch --device cuda[:N]"
    for flag, value in (("--nucleus", args.nucleus), ("--penalties", args.penalties)):
        if value is not None:
            return f"{flag} is about the GPU's sampler: it needs --engine torch --device cuda[:N]"
    return None


def apply(blas_pdl: Optional[bool], nucleus: Optional[str], penalties: Optional[str]) -> None:
    """Set this process's switches, each left as it is where None."""
    if blas_pdl is not None:
        from mstar.runtime.engine.gpu import blas_edges

        blas_edges.set_enabled(blas_pdl)
    if nucleus is not None:
        from mstar.runtime.engine.gpu import sampler

        sampler.set_nucleus(nucleus)
    if penalties is not None:
        from mstar.runtime.engine.gpu import penalties as penalties_module

        penalties_module.set_penalties(penalties)
