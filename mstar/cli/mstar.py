"""`mstar`: run a compiled plan (`mstar run`), serve one over HTTP (`mstar serve`, serve/server.py)
and benchmark the scheduler (`mstar bench scheduler`).

    mstar run --plan generated/orpheus.plan                       # torch engine, tiny dims
    mstar run --plan generated/orpheus.plan --engine sim --requests 10000
    mstar run --plan P --prompts prompts.jsonl --out outdir --report run.json --timeline run.png
    mstar bench scheduler --json
    mstar bench postprocess --plan generated/llama.plan
    mstar bench serve --base-url http://127.0.0.1:8000 --concurrency 32

Exit status: 0 when every request ran (a request that failed alone is reported, not fatal);
1 for a refused plan, a bad workload, an engine that cannot start or an output that could not be
written (one message naming the file, no traceback); 2 for bad command-line usage; 128 + the
signal's number (130 SIGINT, 143 SIGTERM, 129 SIGHUP) for an interrupted run.

Results are written as each request finishes (mstar/runtime/serve/results.py). On SIGINT,
SIGTERM or SIGHUP the run stops admitting and returns after the step in progress (a second
signal: at once); the command then writes the report (`"interrupted": "SIGINT"`) and the
timeline and prints one line saying what was kept.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence

from mstar.arg_types import (
    float_range, int_range, integer, os_error_text, path_problem, shown_error, shown_path, weights_list_problem,
)
from mstar.files import make_dirs, remove_empty_dirs
from mstar.cli.common import global_parser, take_global_options
from mstar.plan.output_bound import most_counted_tokens
from mstar.plan.rounds import max_request_tokens
from mstar.runtime.engine import gpu_switches
from mstar.runtime.engine.prompt_limits import text_prompt_vocab
from mstar.runtime.serve.engine_setup import SEED_BOUND, kv_pages_option_problem
from mstar.runtime.serve.workload import (
    ARRIVALS, MAX_GENERATED_OUTPUT_LEN, MAX_GENERATED_PROMPT_LEN, VOCAB_SIZE, WorkloadError, check_route, generate,
    parse_range, parse_route, read_prompts, route_names, starting_partitions,
)


log = logging.getLogger("mstar.cli.mstar")  # not __name__: under `python3 -m` that is __main__, outside `mstar`


DEFAULT_RANK_TIMEOUT_S = 8.0
RANK_TIMEOUT_S = (0.01, 86400.0)  # below 10 ms torch's store waits 0 ms; its milliseconds overflow a C int past 24 days
# requests/s: past it the arrivals of even 10,000,000 requests lie within 10 ms; a number past the
# float range (5000 digits) read as inf, every arrival at once, without a word
MAX_RATE = 1e9


class CliError(Exception):
    """A user-facing failure: printed as `mstar: error: <message>`, exit 1."""


DEFAULT_RATE = 100.0  # mstar run --rate: requests/s of a poisson or staggered workload


def _run_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run a compiled plan on a workload and print its metrics",
                         description="Run a compiled plan on a generated workload or a prompts file.")
    run.add_argument("--plan", required=True, help="compiled plan (generated/<config>.plan)")
    run.add_argument("--engine", choices=("torch", "sim"), default="torch",
                     help="torch: real models on the CPU (default); sim: cost-model engine")
    # --requests, --concurrency and --kv-pages: their ranges are the workload's and the engine's checks
    run.add_argument("--requests", type=integer, default=8, help="generated requests (default 8)")
    run.add_argument("--concurrency", type=integer, default=8,
                     help="closed-loop clients (default 8; --arrival closed and --prompts)")
    run.add_argument("--prompt-len", default="8..32", help="prompt length range A..B (default 8..32)")
    run.add_argument("--output-len", default="32..64", help="max output tokens range A..B (default 32..64)")
    run.add_argument("--arrival", choices=ARRIVALS, default="closed", help="arrival process (default closed)")
    run.add_argument("--rate", type=float_range(0, MAX_RATE, is_low_open=True),
                     help=f"requests/s for poisson and staggered, in (0, {MAX_RATE:g}] (default {DEFAULT_RATE:g})")
    run.add_argument("--seed", type=int_range(-SEED_BOUND, SEED_BOUND), default=0,
                     help="workload and engine seed (default 0; within +-2**43: request i's seed is "
                          "seed x 1000003 + i, a 64-bit integer)")
    run.add_argument("--prompts", help="JSONL file of requests instead of a generated workload")
    run.add_argument("--route", action="append", default=[], metavar="PARTITION=WALK,WALK",
                     help="walks every request takes in a partition (repeatable), e.g. LLM=prefill_text,image_gen")
    run.add_argument("--out", help="directory for outputs.jsonl and media (WAV, PNG)")
    run.add_argument("--report", help="write the metrics as JSON to this file")
    run.add_argument("--timeline", help="draw step composition and latency over time to this PNG")
    run.add_argument("--dims", choices=("tiny", "spec"), default="tiny", help="torch engine model dims (default tiny)")
    run.add_argument("--weights", action="append", metavar="[NODE=]DIR",
                     help="torch engine: a local checkpoint directory (config.json + *.safetensors) for "
                          "the plan's kv node; NODE=DIR when the plan has several (repeat per node)")
    run.add_argument("--tokenizer", metavar="DIR",
                     help="a directory with tokenizer.json (and tokenizer_config.json for chat messages) for text "
                          "prompts and text outputs; default: the --weights directory of the node taking the text "
                          "prompt, when it holds tokenizer.json")
    run.add_argument("--kv-pages", type=integer, help="KV pool pages per kv node (overrides the plan)")
    run.add_argument("--device", default="cpu",
                     help="torch engine: cpu (fp32, default) or cuda[:N] (bf16: decoders on the device fast path, "
                          "other models under bf16 autocast; KV cache in bf16)")
    run.add_argument("--attention", choices=("auto", "torch", "flashinfer"), default="auto",
                     help="torch engine attention: FlashInfer on a GPU where it can run (auto, default), "
                          "the torch path, or FlashInfer required")
    run.add_argument("--gpu-profile", metavar="TRACE.json",
                     help="torch engine on a GPU: trace the run with the torch profiler into this Chrome "
                          "trace and print how long the GPU sat idle (the report gets it too)")
    run.add_argument("--gpu-idle", action="store_true",
                     help="torch engine on a GPU: time each step of the device fast path with CUDA events and "
                          "print how long the GPU waited for the host between steps (no profiler; the report "
                          "gets it too)")
    run.add_argument("--no-run-ahead", action="store_true",
                     help="torch engine on a GPU: launch each decode step only after the one before was "
                          "collected (default: the device runs the speculated next step behind it; a hybrid "
                          "decoder then keeps two copies of each recurrent state slot)")
    gpu_switches.add_arguments(run)  # --no-blas-pdl, --nucleus, --penalties
    run.add_argument("--ranks", choices=("auto", "inproc", "processes"), default="auto",
                     help="processes: one process per rank of the plan (torch engine; under torchrun each "
                          "process is one rank); inproc: every rank in this process; auto (default): "
                          "processes for the torch engine on a plan of several ranks or under torchrun")
    run.add_argument("--rank-timeout", type=float_range(*RANK_TIMEOUT_S), default=None, metavar="S",
                     help="a rank that does not answer within S seconds stops the run (default 8; "
                          f"{RANK_TIMEOUT_S[0]:g} to {RANK_TIMEOUT_S[1]:g})")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar", description="Run compiled mstar plans.",
                                     parents=[global_parser("mstar")])
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    sub.add_parser("serve", add_help=False,
                   help="serve a plan over an OpenAI-compatible HTTP API (mstar serve --help)")
    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("what", choices=("scheduler", "postprocess", "runner", "lone", "attention", "load", "engine",
                                         "kv", "offload", "serve", "gdn", "products", "sampler"),
                       help="scheduler: host time per step decision; postprocess: host time to post-process "
                            "a step, per step and per row; runner: the GPU fast path's host work per decode "
                            "step (device stubbed, any machine); lone: the host's path of a lone request to its first "
                            "token (device stubbed, any machine); attention: FlashInfer vs torch on a GPU; "
                            "load: checkpoint load time; engine: engine steps against the floor on a GPU; "
                            "kv: decode latency beside a long prompt, chunked or whole; offload: a load with "
                            "and without a KV host pool on the simulated engine; "
                            "serve: load an OpenAI-compatible server over HTTP; gdn: the gated delta-net decode "
                            "kernel's value parts against other widths on a GPU; products: a decoder step's "
                            "matrix products, weights [in, out] against the modules' [out, in], on a GPU; sampler: the "
                            "device sampler's cost a step per kind of request, torch ops against Triton draws")
    return parser


def _load_plan(path: str):
    from mstar.plan.io import PlanError, load_plan

    try:
        return load_plan(path)
    except PlanError as error:
        raise CliError(str(error)) from None


def _engine(plan: Any, args: argparse.Namespace) -> Any:
    log.info("engine %s (device %s, dims %s)", args.engine, args.device, args.dims)
    if args.engine == "sim":
        from mstar.runtime.engine.sim import SimEngine

        return SimEngine(plan, seed=args.seed, num_pages=args.kv_pages)
    try:
        from mstar.runtime.engine import torch_engine
    except ImportError as error:
        raise CliError(f"the torch engine is not available ({error}); use --engine sim") from None
    # before any graph is captured (process-wide, as the modules' switches are)
    gpu_switches.apply(False if args.no_blas_pdl else None, args.nucleus, args.penalties)
    if args.dims == "spec":  # full-size models initialise for a while before the progress bar starts
        from mstar.runtime.engine.placement import resolve_device

        try:  # a device the machine lacks is refused before the wait is announced, not after it
            resolve_device(args.device)
        except ValueError as error:
            raise CliError(str(error)) from None
        print("mstar: building the models at the spec's dims (random weights are drawn on the CPU; "
              "a 1B model takes 10-60 s, by the cores)...", file=sys.stderr, flush=True)
    try:
        return torch_engine.build(plan, args)
    except ValueError as error:  # EngineError and the engine's other start-up refusals
        raise CliError(str(error)) from None


def _tokenizer(plan: Any, args: argparse.Namespace) -> Any:
    """The run's tokenizer (serve/tokenizer.py), or None when neither --tokenizer nor the text
    prompt node's --weights directory gives one."""
    from mstar.runtime.serve.tokenizer import TokenizerError, load_tokenizer, tokenizer_dir

    checkpoints: dict[str, str] = {}
    if args.weights:  # (also beside --tokenizer: tokenizer_dir checks every --weights directory)
        from mstar.runtime.engine.weights import WeightsError, weights_by_node

        try:
            from mstar.runtime.engine.whisper_setup import has_checkpoint_encoder

            others = [n.name for n in plan.nodes if n.model_kind == "audio_codec" or has_checkpoint_encoder(n)]
            checkpoints = weights_by_node([n.name for n in plan.nodes if n.engine == "kv"], args.weights, others)
        except WeightsError as error:
            raise CliError(str(error)) from None
    try:
        directory = tokenizer_dir(plan, checkpoints, args.tokenizer)
        return load_tokenizer(directory) if directory is not None else None
    except TokenizerError as error:
        raise CliError(str(error)) from None


def _workload(args: argparse.Namespace, plan: Any, tokenizer: Any = None) -> Any:
    """The run's requests, each route checked against the plan's partitions and walks."""
    names = route_names(plan)
    try:
        route = parse_route(args.route)
        check_route(route, names, "--route", starting_partitions(plan))
        _check_route_stages(plan, route)
        if args.prompts:
            from mstar.runtime.serve.prompt_format import PromptFormatError, prompt_format_of

            try:
                form = prompt_format_of(plan)
            except PromptFormatError as error:
                raise CliError(str(error)) from None
            from mstar.runtime.serve.audio_input import takes_waveform

            workload = read_prompts(args.prompts, concurrency=args.concurrency, names=names, tokenizer=tokenizer,
                                    form=form, max_output_len=most_counted_tokens(plan),
                                    takes_wav=takes_waveform(plan), plan=plan, seed=args.seed)
            _lay_out_audio(plan, workload, args.prompts)
        else:
            _check_generated_fits(args, plan)
            vocab = text_prompt_vocab(plan)
            workload = generate(
                args.requests,
                vocab_size=min(VOCAB_SIZE, vocab) if vocab else VOCAB_SIZE,
                prompt_len=parse_range(args.prompt_len, "--prompt-len", MAX_GENERATED_PROMPT_LEN),
                output_len=parse_range(args.output_len, "--output-len", MAX_GENERATED_OUTPUT_LEN),
                max_output_len=most_counted_tokens(plan),
                max_seq_len=max_request_tokens(plan),  # as the server bounds them
                arrival=args.arrival,
                concurrency=args.concurrency,
                rate=DEFAULT_RATE if args.rate is None else args.rate,
                seed=args.seed,
            )
    except WorkloadError as error:
        raise CliError(str(error)) from None
    for request in workload.requests:
        for partition, walks in route.items():
            request.route.setdefault(partition, walks)
    return workload


def _check_route_stages(plan: Any, route: dict[str, list[str]]) -> None:
    """`--route`'s walks through each partition's stages, as the conductor follows them: a route
    that leaves out a stage that is not optional failed every request at run time."""
    from mstar.runtime.serve.plan_checks import stages_not_followed

    unfollowed = stages_not_followed({partition.name: partition for partition in plan.partitions}, route)
    if unfollowed is not None:
        raise CliError(f"--route: {unfollowed[1]}")


def _check_generated_fits(args: argparse.Namespace, plan: Any) -> None:
    """A generated workload has no audio: on a plan that lays each prompt out for its clip's audio
    states (serve/audio_prompt.py: Qwen3-ASR's), the torch engine failed every request ("this
    encoder needs the request's audio"); the sim runs them."""
    from mstar.runtime.serve.audio_prompt import AudioPromptError, audio_layout_of

    try:
        has_layout = audio_layout_of(plan) is not None
    except AudioPromptError:
        return  # said with its own message where the prompts are laid out
    if has_layout and args.engine == "torch":
        raise CliError("this plan lays each prompt out for its audio clip (a media_token the encoder's states "
                       "replace), and a generated workload has no audio: give --prompts FILE with an \"audio\" "
                       "WAV per line, or --engine sim")


def _lay_out_audio(plan: Any, workload: Any, prompts_path: str) -> None:
    """Repeat each prompt's audio placeholder once per state of its clip (serve/audio_prompt.py);
    a prompt that cannot take its clip is refused as `FILE:LINE:`, as every bad line is."""
    from mstar.runtime.serve.audio_prompt import AudioPromptError, audio_layout_of, expand

    try:
        layout = audio_layout_of(plan)
    except AudioPromptError as error:
        raise CliError(str(error)) from None
    for request in workload.requests:
        audio = request.media.get("audio")
        try:
            if layout is not None and audio is not None:
                request.prompt_tokens = expand(layout, list(request.prompt_tokens), int(audio.shape[0]))
        except AudioPromptError as error:
            raise CliError(f"{shown_path(prompts_path)}:{_line_of(prompts_path, request.id)}: {error}") from None


def _line_of(path: str, request_id: str) -> str:
    """The line of the prompts file holding `request_id` (read again: only a refusal asks), "?"
    where it cannot be found (a file changed meanwhile)."""
    try:
        with open(path, encoding="utf-8-sig") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    if line.strip() and json.loads(line).get("id") == request_id:
                        return str(number)
                except (ValueError, AttributeError, RecursionError):
                    continue
    except OSError:
        pass
    return "?"


def _check_file_target(option: str, path: str, made_dirs: list) -> None:
    """Refuse a file output that cannot be written: a directory, or an unwritable place."""
    if os.path.isdir(path):
        raise CliError(f"{option} {shown_path(path)} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        made_dirs.extend(make_dirs(parent))
    except OSError as error:
        raise CliError(f"{option} {shown_path(path)}: cannot create directory {shown_path(parent)}: "
                       f"{error.strerror}") from None
    _probe_writable(option, path, parent)


def _probe_writable(option: str, path: str, folder: str) -> None:
    """Write there, not ask `os.access`: as root it says yes to /proc and to read-only mounts, and
    the run then failed at its end (`cannot write /proc/x.json`). An existing file is opened to
    append (left as it is); else a nameless file is made in the folder and dropped at once."""
    try:
        if os.path.isfile(path):
            with open(path, "ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as error:
        raise CliError(f"{option} {shown_path(path)} is not writable ({error.strerror})") from None


def _check_outputs(args: argparse.Namespace, made_dirs: list) -> None:
    """Check --out, --report and --timeline before the run, so a bad path costs no run time; the
    options that need no file first, then the paths, so a refused command creates no directory (a
    sim run given a torch option, or a --report on outputs.jsonl, left its new --out behind). The
    directories made go to `made_dirs`: a refusal after this (weights, the device) removes them."""
    is_on_gpu = args.engine == "torch" and args.device.startswith("cuda")
    if args.gpu_profile and not is_on_gpu:
        raise CliError("--gpu-profile traces the GPU: it needs --engine torch --device cuda[:N]")
    if args.gpu_idle and not is_on_gpu:
        raise CliError("--gpu-idle times steps on the GPU: it needs --engine torch --device cuda[:N]")
    switches_problem = gpu_switches.off_gpu_problem(args, is_on_gpu)
    if switches_problem is not None:
        raise CliError(switches_problem)
    from mstar.runtime.serve.engine_setup import torch_options_set

    torch_only = torch_options_set(args.device, args.dims, args.attention) + ["--no-run-ahead"] * args.no_run_ahead
    if args.engine == "sim" and torch_only:
        one = len(torch_only) == 1
        raise CliError(f"{', '.join(torch_only)} {'chooses' if one else 'choose'} the torch engine's model: use "
                       f"{'it' if one else 'them'} with --engine torch")
    if args.timeline:
        from mstar.runtime.serve.timeline import format_problem

        problem = format_problem(args.timeline)
        if problem:
            raise CliError(f"--timeline {shown_path(args.timeline)}: {problem}")
    _check_distinct_files(args)
    if args.out:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise CliError(f"--out {shown_path(args.out)} exists and is not a directory")
        try:
            made_dirs.extend(make_dirs(args.out))
        except OSError as error:
            raise CliError(f"--out {shown_path(args.out)}: cannot create directory: {error.strerror}") from None
        _probe_writable("--out", args.out, args.out)
    for option, path in (("--report", args.report), ("--timeline", args.timeline),
                         ("--gpu-profile", args.gpu_profile)):
        if path:
            _check_file_target(option, path, made_dirs)


def _check_paths_given(args: argparse.Namespace) -> None:
    """A path the OS cannot name (arg_types.path_problem) is refused before anything is read: an
    empty one to write was taken for no option (exit 0, nothing written), one to read for the
    working directory (`--plan ""`: "cannot read plan .: is a directory"); a name past NAME_MAX
    raised ENAMETOOLONG wherever it was first used, its 5,000 characters in the message. Exit 1
    with the command's other refusals, as `mstar run` refused an empty path before path_arg."""
    for option in ("plan", "prompts", "tokenizer", "out", "report", "timeline", "gpu_profile"):
        path = getattr(args, option)
        problem = path_problem(path) if path is not None else None
        if problem is not None:
            raise CliError(f"--{option.replace('_', '-')} {problem}")
    problem = weights_list_problem(args.weights)
    if problem is not None:
        raise CliError(f"--weights {problem}")


def _check_distinct_files(args: argparse.Namespace) -> None:
    """No file the run writes is another it writes or one it reads: `--report` on the run's own
    outputs.jsonl, or on its `--timeline`, replaced it without a word (and on `--plan` or
    `--prompts`, an input)."""
    writes = [(option, path) for option, path in (("--report", args.report), ("--timeline", args.timeline),
                                                  ("--gpu-profile", args.gpu_profile)) if path]
    taken = {os.path.realpath(path): option for option, path in (("--plan", args.plan), ("--prompts", args.prompts))
             if path}
    if args.out:
        taken[os.path.realpath(os.path.join(args.out, "outputs.jsonl"))] = "--out's outputs.jsonl"
    for option, path in writes:
        real = os.path.realpath(path)
        if real in taken:
            raise CliError(f"{option} {shown_path(path)} is the file of {taken[real]}: give it a path of its own")
        taken[real] = option


class _Interrupted(BaseException):
    """A signal that ends the command now (before the run, or a second one during it). A
    BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT, SIGTERM and SIGHUP while `mstar run` works (a context manager).

    Before the run a signal ends the command at once (`_Interrupted`). During the run the first
    one stops the driver (it returns after the step in progress) and a second one ends the run
    at once, though never inside `held()` (a request's media and its line): it ends the run when
    the block is done; either way the command then writes what finished. After the run a signal
    is only noted (the exit status says which), and a second one abandons the report and timeline
    (`abandonable()`: a report to a FIFO nobody reads would otherwise block the command); it ended
    the command from wherever it came, outputs.jsonl's close among them, and the command then
    said "before the run started; nothing was written" with lines kept.
    """

    HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.driver: Any = None
        self.is_writing = False
        self.is_reported = False  # the run's outcome is written and said: a signal now changes nothing
        # a rank was lost: the run's outcome is the loss, and the first signal after it (torchrun's
        # agent stopping the group once a rank died) changes nothing; a second one still ends the command
        self.is_lost = False
        self.is_lost_signalled = False
        self.is_ending = False  # after the run: a second signal came (the report and timeline are abandoned)
        self.is_abandonable = False
        self._num_holding = 0
        self._is_held = False
        self._has_raised = False  # an _Interrupted was raised: later signals are only the first's echo
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in self.HANDLED:
                # A signal the parent set to be ignored stays ignored: `nohup mstar run` was stopped
                # by the hangup, and a script's background run by its Ctrl-C.
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.is_reported or self._has_raised:  # (the engine's teardown after the run: a second Ctrl-C
            return  # there said "before the run started; nothing was written"; one _Interrupted is raised at
            # most: a second, while the command said the first, was a traceback and exit 1)
        if self.is_lost and not self.is_lost_signalled:  # (it marked the report "interrupted: SIGTERM")
            self.is_lost_signalled = True
            return
        is_first = self.signum is None
        first_signum = signum if self.signum is None else self.signum
        self.signum = first_signum
        if self.is_writing:
            self.is_ending = self.is_ending or not is_first
            if self.is_ending and self.is_abandonable:
                self._has_raised = True
                raise _Interrupted(first_signum)
            return
        if is_first and self.driver is not None:
            self.driver.stop()
            return
        if self._num_holding:
            self._is_held = True
            return
        self._has_raised = True
        raise _Interrupted(first_signum)

    def begin_writing(self) -> None:
        """The run is over (however it ended): what finished is written now; a signal from here on
        follows `is_writing`'s rules (an _Interrupted the run raised is caught by now)."""
        self.is_writing = True
        self._has_raised = False

    @contextlib.contextmanager
    def held(self) -> Any:
        """A signal that would end the run waits for the block's end: ending between a request's
        media and its line left the media without a line and the finished request unwritten."""
        self._num_holding += 1
        try:
            yield
        finally:
            self._num_holding -= 1
        if self._is_held and not self._num_holding:
            self._is_held = False
            self._has_raised = True
            raise _Interrupted(self.signum or signal.SIGINT)

    @contextlib.contextmanager
    def abandonable(self) -> Any:
        """The report and timeline: a second signal, during them or noted since the run ended,
        abandons them (`_Interrupted`)."""
        if self.is_ending:
            self._has_raised = True
            raise _Interrupted(self.signum or signal.SIGINT)
        self.is_abandonable = True
        try:
            yield
        finally:
            self.is_abandonable = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def _write_report(path: str, summary: dict[str, Any]) -> Optional[str]:
    """None, or the message of a failed write (the outputs are already on disk either way)."""
    from mstar.runtime.serve.results import OutputError, write_output_file

    try:
        write_output_file(path, (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    except OutputError as error:
        return f"--report: {error}"
    return None


def _draw_timeline(path: str, driver: Any, records: list[Any]) -> Optional[str]:
    from mstar.runtime.serve.results import OutputError
    from mstar.runtime.serve.timeline import draw

    try:
        draw(driver.log, records, path, origin_s=driver.origin_s)
    except OutputError as error:
        return f"--timeline: {error}"
    except Exception as error:  # matplotlib's own (a backend's missing tool): the outputs are kept
        return f"--timeline: matplotlib could not draw {shown_path(path)}: {type(error).__name__}: {error}"
    return None


def _say(text: str) -> None:
    """A line on stderr; a closed terminal (SIGHUP) loses it rather than failing the command."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


def run_command(args: argparse.Namespace) -> int:
    with _Signals() as signals:
        try:
            code = _run(args, signals)
        except _Interrupted as stop:
            _say(f"mstar: interrupted by {signal.Signals(stop.signum).name} before the run started; "
                 "nothing was written")
            return 128 + stop.signum
    if getattr(args, "lost_rank", False) or getattr(args, "is_abandoned_mid_step", False):
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> None:
    """End the process now, after a rank process was lost (or killed by a second signal while its
    step's answer was due). Everything the run writes (outputs, the
    report, the error lines) is written and the rank processes are gone, but a wait on the lost
    rank's connection may still sit in the process group's transport, and tearing that down at
    exit aborted the process about one run in four on a loaded 2-core machine ("terminate called
    without an active exception", exit -6 instead of 1): the interpreter's teardown is skipped."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _ranks_mode(args: argparse.Namespace, plan: Any) -> str:
    """How the plan's ranks run: `inproc` (one process), `spawn` (one child per rank) or
    `torchrun` (this process is one rank of a torchrun launch)."""
    num_ranks = max(worker.rank for worker in plan.workers) + 1
    is_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"] != "1"
    if is_torchrun and (args.ranks == "inproc" or args.engine == "sim"):
        # (each of torchrun's processes ran the whole workload, writing over the others' --out)
        raise CliError(f"torchrun started {os.environ['WORLD_SIZE']} processes, one a rank, but "
                       f"{'--engine sim' if args.engine == 'sim' else '--ranks inproc'} runs every rank in one "
                       "process: run it without torchrun")
    if args.ranks == "inproc":
        return "inproc"
    if args.engine == "sim":
        if args.ranks == "processes":
            raise CliError("--ranks processes runs the torch engine; --engine sim runs every rank in one process")
        return "inproc"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != num_ranks:
            raise CliError(f"torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes but plan "
                           f"{shown_path(args.plan)} has {num_ranks} ranks; start one process per rank")
        return "torchrun"
    return "spawn" if args.ranks == "processes" or num_ranks > 1 else "inproc"


def _rank_engine(plan: Any, args: argparse.Namespace, mode: str, stack: contextlib.ExitStack) -> Any:
    """Rank 0's engine over the rank processes (serve/ranks), closed with `stack`."""
    from mstar.runtime.serve.ranks.launch import LaunchError, RankProcesses

    try:
        ranks = stack.enter_context(RankProcesses(args.plan, plan, _rank_options(args), mode == "torchrun"))
    except (LaunchError, ValueError) as error:  # EngineError and the engine's other start-up refusals
        raise CliError(str(error)) from None
    return ranks.engine


def _rank_options(args: argparse.Namespace) -> Any:
    from mstar.runtime.serve.ranks.worker import RankOptions

    return RankOptions(dims=args.dims, weights=args.weights, seed=args.seed, kv_pages=args.kv_pages,
                       device=args.device, attention=args.attention,
                       timeout_s=DEFAULT_RANK_TIMEOUT_S if args.rank_timeout is None else args.rank_timeout,
                       plan_path=args.plan, blas_pdl=not args.no_blas_pdl, nucleus=args.nucleus,
                       penalties=args.penalties)


def _serve_rank(args: argparse.Namespace, plan: Any) -> int:
    """A rank other than 0 under torchrun: serve rank 0 until it stops the run."""
    from mstar.runtime.serve.ranks.launch import LaunchError, serve_torchrun

    try:
        serve_torchrun(plan, _rank_options(args))
    except (LaunchError, ValueError) as error:  # (LaunchError: rank 0 gone, a rendezvous that failed)
        raise CliError(str(error)) from None
    return 0


def _run(args: argparse.Namespace, signals: _Signals) -> int:
    _check_paths_given(args)
    if args.rate is not None and (args.prompts or args.arrival == "closed"):  # (it was ignored, exit 0)
        raise CliError("--rate sets the arrivals of --arrival poisson or staggered; this run's are "
                       + ("the prompts file's" if args.prompts else "closed (the default: each client sends its next "
                                                                    "request when its last ends)"))
    plan = _load_plan(args.plan)
    mode = _ranks_mode(args, plan)
    if mode == "inproc" and args.rank_timeout is not None:  # (it was ignored)
        raise CliError("--rank-timeout bounds the wait for rank processes, and this run has none (every rank "
                       "runs in this process: --ranks inproc, --engine sim or a plan of one rank)")
    if mode == "torchrun" and os.environ["RANK"] != "0":
        return _serve_rank(args, plan)
    tokenizer = _tokenizer(plan, args)
    workload = _workload(args, plan, tokenizer)
    made_dirs: list = []
    try:
        _check_outputs(args, made_dirs)
        problem = kv_pages_option_problem(args.kv_pages)  # either engine's, before it is built
        if problem is not None:
            raise CliError(problem)
        with contextlib.ExitStack() as stack:
            engine = _engine(plan, args) if mode == "inproc" else _rank_engine(plan, args, mode, stack)
            return _run_engine(args, signals, plan, tokenizer, workload, engine, mode)
    except BaseException:
        # Refused after the output folders were made (--weights without config.json, --device cuda
        # without a GPU): the new, still empty folders went with it. One the run wrote to stays.
        remove_empty_dirs(made_dirs)
        raise


def _run_engine(args: argparse.Namespace, signals: _Signals, plan: Any, tokenizer: Any, workload: Any,
                engine: Any, mode: str) -> int:
    from mstar.runtime.serve.driver import Driver, DriverError
    from mstar.runtime.scheduler.key_tables import PlanTableError
    from mstar.runtime.serve.results import OutputError

    writer = _result_writer(args, plan, tokenizer)
    progress = _progress_bar(args, len(workload.requests))
    problems: list[str] = []

    def on_finish(request_ids: list[str]) -> None:
        # Each request's results go to disk as it finishes, so an interrupt loses none of them.
        if progress is not None:
            progress.update(len(request_ids))
        if writer is None or problems:
            return
        with signals.held():
            for request_id in request_ids:
                try:
                    writer.write(driver.conductor.records[request_id])
                except OutputError as error:  # a full disk: stop, keep what was written, say where
                    problems.append(f"--out: {error}")
                    driver.stop()
                    return

    args.step_events = _step_events(args, engine, mode)
    try:
        driver = Driver(plan, engine, on_finish=on_finish, decode=tokenizer.decode if tokenizer is not None else None)
    except (DriverError, PlanTableError) as error:  # a plan whose tables do not hold together
        raise CliError(str(error)) from None
    signals.driver = driver
    started = time.perf_counter()
    _drive(args, signals, driver, workload, writer, problems)
    host_wall_s = time.perf_counter() - started
    _write_unwritten(writer, driver, problems)
    _close_outputs(progress, writer, problems)
    if mode != "inproc":  # ranks as processes: the engine is serve/ranks/controller.RankEngines
        args.ranks_summary = engine.summary(mode)
    records = list(driver.conductor.records.values())
    num_unfinished = sum(1 for r in records if not r.is_finished) + len(workload.requests) - len(records)
    is_lost = getattr(args, "lost_rank", False)  # the lost rank's line says why its requests failed
    if not is_lost:
        problems.extend(_every_request_failed(records))
    if num_unfinished and not signals.signum:
        problems.append(_unfinished_problem(num_unfinished, len(workload.requests), is_lost, driver.is_stopped))
    try:
        with signals.abandonable():
            _finish(args, driver, records, host_wall_s, num_unfinished, signals, problems)
    except _Interrupted:
        problems.append("stopped by a second signal while writing the report and timeline")
    for problem in problems:
        _say(f"mstar: error: {problem}")
    if signals.signum:
        _say(f"mstar: interrupted by {signals.name}: " + _kept(args, writer, records, num_unfinished, problems))
    signals.is_reported = True
    return 128 + signals.signum if signals.signum else (1 if problems else 0)


def _unfinished_problem(num_unfinished: int, num_requests: int, is_lost: bool, is_stopped: bool) -> str:
    """Why requests never finished, without a signal: a lost rank, a failed --out write (the only
    other `driver.stop()`: it was said as "the run could not admit or advance them", wrongly), or
    the loop ended with requests it could neither admit nor advance (a plan admitting none ran
    nothing and exited 0)."""
    reason = ("the run stopped when it lost the rank" if is_lost
              else "the run stopped at the failed --out write" if is_stopped
              else "the run could not admit or advance them")
    return f"{num_unfinished} of {num_requests} requests never finished: {reason}"


def _result_writer(args: argparse.Namespace, plan: Any, tokenizer: Any) -> Any:
    """The ResultWriter of `--out` (a CliError when its folder cannot be written), else None."""
    from mstar.runtime.serve.endpoints import endpoints_of, load_media_encoders
    from mstar.runtime.serve.results import OutputError, ResultWriter, sample_rate_of

    if not args.out:
        return None
    try:
        writer = ResultWriter(args.out, sample_rate_of(plan), tokenizer)
    except OutputError as error:
        raise CliError(str(error)) from None
    load_media_encoders(endpoints_of(plan))
    return writer


def _progress_bar(args: argparse.Namespace, num_requests: int) -> Any:
    """The run's progress bar on stderr (drawn only on a terminal), None with --no-progress."""
    if args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=num_requests, desc="requests", unit="req", file=sys.stderr, disable=not sys.stderr.isatty())


def _drive(args: argparse.Namespace, signals: _Signals, driver: Any, workload: Any, writer: Any,
           problems: list[str]) -> None:
    """Run the workload; a lost rank or a second signal ends it with what finished kept."""
    from mstar.runtime.serve.driver import DriverError
    from mstar.runtime.scheduler.key_tables import PlanTableError
    from mstar.runtime.step import EngineLost

    try:
        with _gpu_profiled(args):
            driver.run(workload)
    except (DriverError, PlanTableError) as error:
        if writer is not None:
            writer.close()
        raise CliError(str(error)) from None
    except _Interrupted:  # a second signal: the step in progress is abandoned; what finished is kept
        abandon = getattr(driver.engine, "abandon", None)  # ranks as processes (serve/ranks/controller.py)
        if abandon is not None:
            abandon()  # nothing more to the ranks: they are killed, and the process ends without teardown
            args.is_abandoned_mid_step = True
    except EngineLost as error:  # a rank process is gone: its requests fail, the run stops
        signals.is_lost = True
        driver.fail_active(str(error))
        problems.append(str(error))
        args.lost_rank = True  # run_command ends the process without the transport's teardown
    finally:
        signals.begin_writing()


def _write_unwritten(writer: Any, driver: Any, problems: list[str]) -> None:
    """The lines of finished requests that on_finish never got to: a second signal between the
    conductor ending a request and the driver's on_finish call ended the run with the request
    counted finished and its output in memory only. Signals are only noted by now (`is_writing`)."""
    from mstar.runtime.serve.results import OutputError

    if writer is None or problems:  # (a failed write stopped the run: nothing more is written)
        return
    for record in driver.conductor.records.values():
        if record.is_finished and not writer.has_written(record.request.id):
            try:
                writer.write(record)
            except OutputError as error:
                problems.append(f"--out: {error}")
                return


def _close_outputs(progress: Any, writer: Any, problems: list[str]) -> None:
    """Close the progress bar and `--out`'s files (a failure to finish them is a problem)."""
    from mstar.runtime.serve.results import OutputError

    if progress is not None:
        progress.close()
    if writer is not None:
        try:
            writer.close()
        except OutputError as error:
            problems.append(f"--out: {error}")


def _every_request_failed(records: list[Any]) -> list[str]:
    """The run's problem when not one request ended well (the run exits 1: a script running it must
    not read a run of refusals as a success), else none."""
    failed = [r.finish_reason for r in records if r.is_finished and (r.finish_reason or "").startswith("error")]
    if not records or len(failed) < len(records):
        return []
    return [f"every request failed ({len(failed)}); the first with {failed[0]}"]


def _step_events(args: argparse.Namespace, engine: Any, mode: str) -> dict[str, Any]:
    """`--gpu-idle`: CUDA events on each step of the engine's device fast-path runners (node ->
    `StepEvents`); ranks as processes keep their runners in other processes, so it needs inproc."""
    if not args.gpu_idle:
        return {}
    if mode != "inproc":
        raise CliError("--gpu-idle times the steps of this process's engine: it needs --ranks inproc")
    from mstar.runtime.engine.gpu.step_events import attach

    events = attach(engine)
    if not events:
        raise CliError("--gpu-idle: no kv node of this plan runs on the device fast path (docs/engine.md)")
    return events


def _gpu_profiled(args: argparse.Namespace) -> Any:
    if not args.gpu_profile:
        return contextlib.nullcontext()
    from mstar.runtime.serve.gpu_profile import profiled

    return profiled(args.gpu_profile)


def _finish(args: argparse.Namespace, driver: Any, records: list[Any], host_wall_s: float, num_unfinished: int,
            signals: _Signals, problems: list[str]) -> None:
    """The table, the report and the timeline of a run that ended (or was stopped)."""
    from mstar.runtime.serve.metrics import error_lines, render_table, summarize
    from mstar.runtime.serve.plan_summary import plan_summary

    summary = summarize(records, driver.log, host_wall_s)
    summary["plan"] = args.plan
    summary["plan_summary"] = plan_summary(driver.plan)
    summary["engine"] = args.engine
    summary["interrupted"] = signals.name or None
    summary["num_unfinished"] = num_unfinished
    # requests of the workload that never arrived are unfinished too (the counts named only those
    # admitted: 16 against 232 in one interrupted run)
    never_arrived = num_unfinished - sum(1 for r in records if not r.is_finished)
    if never_arrived:
        summary["num_requests"] += never_arrived  # the workload's, as the finish counts are
        for key in ("finish_reasons", "finish_kinds"):
            summary[key]["unfinished"] = summary[key].get("unfinished", 0) + never_arrived
    summary["ranks"] = getattr(args, "ranks_summary", None) or {"mode": "inproc"}
    # None where the engine cannot say (a rank process lost, or stopped mid-step)
    offload_figures = getattr(driver.engine, "offload_figures", None)
    summary["kv_offload"] = offload_figures() if offload_figures else None
    if args.gpu_profile and os.path.exists(args.gpu_profile):
        from mstar.runtime.serve.gpu_profile import idle_summary, summary_line

        summary["gpu_profile"] = idle_summary(args.gpu_profile)
        _say(summary_line(summary["gpu_profile"]))
    if getattr(args, "step_events", None):
        from mstar.runtime.engine.gpu import step_events

        summary["gpu_idle"] = {node: events.summary() for node, events in args.step_events.items()}
        for node, value in summary["gpu_idle"].items():
            _say(step_events.summary_line(node, value))
    if not signals.signum:
        try:
            from rich.console import Console

            Console().print(render_table(summary))
        except OSError:
            pass
        for line in error_lines(records):
            _say(f"mstar: {line}")
    if args.report:
        problem = _write_report(args.report, summary)
        if problem:
            problems.append(problem)
    if args.timeline:
        problem = _draw_timeline(args.timeline, driver, records)
        if problem:
            problems.append(problem)


def _kept(args: argparse.Namespace, writer: Any, records: list[Any], num_unfinished: int,
          problems: list[str]) -> str:
    """What an interrupted run kept, in one line."""
    num_finished = sum(1 for r in records if r.is_finished)
    parts = [f"{num_finished} requests finished, {num_unfinished} not"]
    if writer is not None:
        parts.append(f"kept {writer.num_lines} in {shown_path(writer.path)} with {writer.num_media} media files")
    is_report_written = not any(p.startswith(("--report", "stopped")) for p in problems)
    if args.report and is_report_written:
        parts.append(f"report {shown_path(args.report)} marked interrupted")
    return "; ".join(parts)


# `mstar bench WHAT` -> the module whose main(argv) runs it (imported when asked for: `import mstar` stays light)
BENCHES = {"scheduler": "mstar.runtime.serve.bench_scheduler", "postprocess": "mstar.runtime.serve.bench_postprocess",
           "runner": "mstar.runtime.serve.bench_runner", "lone": "mstar.runtime.serve.bench_lone",
           "attention": "mstar.runtime.serve.bench_attention", "load": "mstar.runtime.serve.bench_load",
           "kv": "mstar.runtime.serve.bench_kv", "offload": "mstar.runtime.serve.bench_offload",
           "serve": "mstar.runtime.serve.bench_serve",
           "gdn": "mstar.runtime.engine.gpu.bench_gdn", "products": "mstar.runtime.engine.gpu.bench_products",
           "engine": "mstar.runtime.engine.gpu.bench", "sampler": "mstar.runtime.engine.gpu.bench_sampler"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    # `mstar serve` hands its --log-level to uvicorn too
    argv = take_global_options(sys.argv[1:] if argv is None else argv, "mstar", own_log_level=("serve",))
    if argv[:1] == ["serve"]:
        return _guarded(lambda: importlib.import_module("mstar.runtime.serve.server").main(argv[1:]))
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCHES:
        return _guarded(lambda: importlib.import_module(BENCHES[argv[1]]).main(argv[2:]))
    args = _parser().parse_args(argv)
    return _guarded(lambda: run_command(args))


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll says POLLERR on its writing end),
    so a BrokenPipeError came from the reader of the command's own output going away."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, a closed one, no poll on this system
        return False


def _guarded(command: Callable[[], int]) -> int:
    """Run a command; what it did not turn into an error line of its own becomes one here, never a
    traceback (each bench and `mstar serve` say their own errors; this catches what they missed)."""
    try:
        return command()
    except CliError as error:
        print(f"mstar: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError as error:
        if _stdout_reader_gone():  # `mstar bench ... | head`: nothing left to say, to anyone (as mstarc)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return 0
        print(f"mstar: error: {os_error_text(error)}", file=sys.stderr)  # another pipe: a --report FIFO
        return 1
    except OSError as error:  # str(error) held "[Errno N]" and the whole file name (5,000 characters)
        print(f"mstar: error: {os_error_text(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before `mstar run` set its own handlers
        print("mstar: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Interrupted as stop:  # (a backstop: `_Signals` raises one at most, and its command says it)
        return 128 + stop.signum
    except MemoryError:
        print("mstar: error: out of memory (a pool or an input larger than this machine holds)", file=sys.stderr)
        return 1
    except Exception as error:  # a bug (or a plan edited by hand with its hash redone): no traceback
        if os.environ.get("MSTAR_TRACEBACK"):
            raise
        print(f"mstar: internal error ({shown_error(error)}); this is a bug in mstar, or the "
              "plan was edited by hand (recompile it with mstarc). Set MSTAR_TRACEBACK=1 to see where.",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    from mstar.cli.launch import finish

    sys.exit(finish(main))
