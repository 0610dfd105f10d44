"""The GPU fast path's what-if switches that `mstar bench engine` and `mstar bench kv` both take:
one declaration of each flag and one place that sets its module's switch, so the two benches
cannot drift apart. Each switch is set before any graph is captured; `apply` sets every one,
to its default where its flag is absent."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


def _blas_pdl(given: bool) -> None:
    from mstar.runtime.engine.gpu import blas_edges

    blas_edges.set_enabled(not given)


def _flashinfer_packed(given: bool) -> None:
    from mstar.runtime.engine.gpu import packed_graphs

    packed_graphs.set_triton_packed(not given)


def _fold_norms(given: bool) -> None:
    from mstar.runtime.engine.gpu import norm_folding

    norm_folding.set_enabled(given)


def _merge_in_kernel(given: bool) -> None:
    from mstar.runtime.engine.gpu import decode_attention

    decode_attention.set_merge_in_kernel(given)


@dataclass(frozen=True)
class WhatIf:
    flag: str
    help: str
    set_switch: Callable[[bool], None]  # called with whether the flag was given

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


WHAT_IFS = (
    WhatIf("--no-blas-pdl", "keep the graphs' edges into cuBLAS's sm_90 products ordinary, not programmatic "
           "(docs/engine.md, \"Programmatic edges into cuBLAS\")", _blas_pdl),
    WhatIf("--flashinfer-packed", "run the whole packed graphs' one-call (packed) keys on FlashInfer's graph-mode "
           "prefill, not the Triton prefill kernel (docs/engine.md, \"Whole packed keys on the Triton prefill "
           "kernel\")", _flashinfer_packed),
    WhatIf("--fold-norms", "fold each layer's norms into the products after them and the residual adds into o and "
           "down: two kernels fewer a layer; 2%% quicker decode on the H200, its capture pools under the estimate "
           "(docs/engine.md, \"Norms folded into the products\")", _fold_norms),
    WhatIf("--decode-merge-in-kernel", "merge the Triton decode attention's splits in its last program, not a "
           "merge kernel a layer; slower on the H200 (docs/engine.md, \"Decode attention in Triton\")",
           _merge_in_kernel),
)


def add_arguments(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """Declares every what-if flag; `scope` starts each help text (where the bench also runs elsewhere)."""
    for what_if in WHAT_IFS:
        parser.add_argument(what_if.flag, action="store_true", help=f"{scope}{what_if.help} (a what-if)")


def given(args: argparse.Namespace) -> list[str]:
    """The what-if flags given."""
    return [what_if.flag for what_if in WHAT_IFS if getattr(args, what_if.dest)]


def apply(args: argparse.Namespace) -> None:
    """Sets every switch from its flag: the what-if where given, the default where not."""
    for what_if in WHAT_IFS:
        what_if.set_switch(getattr(args, what_if.dest))
