"""Plan, tokenizer and engine for a server or the Python API, from options like `mstar run`'s.

    load(path) -> Plan                                  (SetupError: the plan is refused)
    build_tokenizer(plan, weights, tokenizer) -> TextTokenizer or None
    prompt_format(plan) -> the plan's PromptFormatPlan for text prompts, or None
    build_engine(plan, kind, weights=..., dims=..., kv_pages=..., device=..., attention=...,
                 seed=..., sim_pace=...) -> engine

`kind` is "torch" (the models: tiny or spec dims, random weights or `weights` checkpoints, CPU or
GPU) or "sim" (the cost model, paced to the wall clock by `sim_pace`: serve/paced.py). Every
refusal is a `SetupError` (a ValueError) with the message the user needs; never a traceback.
"""
from __future__ import annotations

import math
import numbers
import os
from types import SimpleNamespace
from typing import Any, Optional

from mstar.arg_types import path_problem, shown, weights_list_problem
from mstar.plan.schema import Plan

ENGINES = ("torch", "sim")
SEED_BOUND = 2**43  # a seed within +-2**43: request i's seed, seed x 1000003 + i, stays a 64-bit integer


class SetupError(ValueError):
    """The plan, the tokenizer or the engine cannot be set up (the message says why)."""


def torch_options_set(device: str, dims: str, attention: str) -> list[str]:
    """The torch engine's model options given other than their defaults (`--device`, `--dims`,
    `--attention`): `mstar run` and `mstar serve` refuse them with the sim engine, which has no
    model to place or size (they were ignored, so a mistyped `--engine` went unnoticed)."""
    return [option for option, is_set in (("--device", device != "cpu"), ("--dims", dims != "tiny"),
                                           ("--attention", attention != "auto")) if is_set]


def load(path: str) -> Plan:
    from mstar.plan.io import PlanError, load_plan

    problem = path_problem(path)  # as path_arg refuses it for `mstar serve --plan`
    if problem is not None:
        raise SetupError(f"plan {problem}")
    try:
        return load_plan(path)
    except PlanError as error:
        raise SetupError(str(error)) from None


def build_tokenizer(plan: Plan, weights: Optional[list[str]], tokenizer: Optional[str]) -> Any:
    """The tokenizer (serve/tokenizer.py): `tokenizer` DIR, else the weights directory of the
    node taking the text prompt when it holds tokenizer.json, else None."""
    from mstar.runtime.serve.tokenizer import TokenizerError, load_tokenizer, tokenizer_dir

    check_paths(weights, tokenizer)
    try:
        checkpoints: dict[str, str] = {}
        if weights:  # (also beside a tokenizer: tokenizer_dir checks every weights directory)
            from mstar.runtime.engine.weights import weights_by_node  # brings torch: only with weights
            from mstar.runtime.engine.whisper_setup import has_checkpoint_encoder

            checkpoints = weights_by_node([n.name for n in plan.nodes if n.engine == "kv"], weights,
                                          [n.name for n in plan.nodes if n.model_kind == "audio_codec"
                                           or has_checkpoint_encoder(n)])
        directory = tokenizer_dir(plan, checkpoints, tokenizer)
        return load_tokenizer(directory) if directory is not None else None
    except TokenizerError as error:
        raise SetupError(str(error)) from None
    except ValueError as error:  # WeightsError: a --weights entry that names no kv node
        raise SetupError(str(error)) from None


def audio_layout(plan: Plan) -> Any:
    """How the plan's prompt holds audio states (serve/audio_prompt.py), or None."""
    from mstar.runtime.serve.audio_prompt import AudioPromptError, audio_layout_of

    try:
        return audio_layout_of(plan)
    except AudioPromptError as error:
        raise SetupError(str(error)) from None


def prompt_format(plan: Plan) -> Any:
    """The plan's prompt format for text prompts (serve/prompt_format.py), or None."""
    from mstar.runtime.serve.prompt_format import PromptFormatError, prompt_format_of

    try:
        return prompt_format_of(plan)
    except PromptFormatError as error:
        raise SetupError(str(error)) from None


def build_engine(plan: Plan, kind: str, *, weights: Optional[list[str]] = None, dims: str = "tiny",
                 kv_pages: Optional[int] = None, device: str = "cpu", attention: str = "auto", seed: int = 0,
                 sim_pace: float = 1.0, plan_path: Optional[str] = None) -> Any:
    """plan_path: where the plan was read (its generated glue packs the GPU fast path's steps)."""
    if kind not in ENGINES:
        raise SetupError(f"engine {kind!r}: choose one of {', '.join(ENGINES)}")
    _check_engine_arguments(kind, weights, kv_pages, seed, sim_pace, torch_options_set(device, dims, attention))
    if kind == "sim":
        from mstar.runtime.engine.sim import SimEngine
        from mstar.runtime.serve.paced import PacedEngine

        return PacedEngine(SimEngine(plan, seed=seed, num_pages=kv_pages), sim_pace)
    try:
        from mstar.runtime.engine import torch_engine
    except ImportError as error:
        raise SetupError(f"the torch engine is not available ({error}); use the sim engine") from None
    options = SimpleNamespace(dims=dims, weights=weights, seed=seed, kv_pages=kv_pages, device=device,
                              attention=attention, plan=plan_path)
    try:
        return torch_engine.build(plan, options)
    except ValueError as error:  # EngineError and the engine's other start-up refusals
        raise SetupError(str(error)) from None


def kv_pages_option_problem(kv_pages: Optional[int]) -> Optional[str]:
    """Why `--kv-pages` (mstar run's and mstar serve's, an integer by argparse) is refused: not a
    positive number of pages; else None. The Python API's `kv_pages` has its own words, below."""
    if kv_pages is not None and kv_pages <= 0:
        return f"--kv-pages must be a positive number of pages, got {shown(kv_pages)}"
    return None


def _check_engine_arguments(kind: str, weights: Any, kv_pages: Any, seed: Any, sim_pace: Any,
                            torch_only: list[str]) -> None:
    """SetupError for an engine argument of the wrong kind or range, as `mstar run` refuses it (the
    Python API passed them on: seed=1.5 gave float token ids, seed="x" and sim_pace=inf failed
    every request, kv_pages="5" raised a TypeError, and the sim engine took dims, device and weights
    it has no model for)."""
    check_paths(weights, None)
    if kv_pages is not None and (not is_integer(kv_pages) or kv_pages <= 0):
        raise SetupError(f"kv pages must be a positive integer, got {shown(kv_pages)}")
    if not is_integer(seed) or abs(seed) > SEED_BOUND:
        raise SetupError(f"seed must be an integer within +-2**43, got {shown(seed)}")
    if kind != "sim":
        return
    if not is_real(sim_pace) or not 0 <= float(sim_pace) < math.inf:
        raise SetupError(f"the simulated engine's pace must be a finite number >= 0, got {shown(sim_pace)}")
    if torch_only:  # weights may come with the sim engine: their folder may hold the tokenizer
        raise SetupError(f"{', '.join(o.lstrip('-') for o in torch_only)}: options of the torch engine's model; "
                         "the sim engine has none (leave them out, or use engine='torch')")


def check_paths(weights: Any, tokenizer: Any) -> None:
    """SetupError unless `weights` is None or a list of directories (DIR or NODE=DIR) and
    `tokenizer` None or a directory (a None or an int among them raised from deep inside), each a
    path the OS can name, as path_arg takes it for `mstar serve` (`tokenizer="x" * 10000` raised
    ENAMETOOLONG from Path.is_file, the whole name in the OSError)."""
    if weights is not None and (isinstance(weights, (str, bytes)) or not isinstance(weights, (list, tuple))
                                or not all(isinstance(w, (str, os.PathLike)) for w in weights)):
        raise SetupError(f"weights must be a list of checkpoint directories (DIR or NODE=DIR), got {shown(weights)}")
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        raise SetupError(f"tokenizer must be a directory holding tokenizer.json, got {shown(tokenizer)}")
    problem = path_problem(tokenizer) if tokenizer is not None else None
    if problem is not None:
        raise SetupError(f"tokenizer {problem}")
    problem = weights_list_problem(weights)
    if problem is not None:
        raise SetupError(f"weights entry {problem}")


def is_integer(value: Any) -> bool:
    """An integer of any kind (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number of any kind (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
