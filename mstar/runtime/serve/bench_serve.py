"""`mstar bench serve`: load an OpenAI-compatible endpoint (mstar serve, vLLM, SGLang) and measure it.

    mstar bench serve --base-url http://127.0.0.1:8000 --requests 200 --concurrency 32
    mstar bench serve --base-url URL --model M --request-rate 20 --prompt-len 128..512 --output-len 64
    mstar bench serve --base-url URL --dataset prompts.jsonl --concurrency 8 --json

Requests: generated as `mstar run` generates them (the same --requests, --prompt-len, --output-len
and --seed give the same prompt token ids and max_tokens; bench_serve_requests.py), as token ids
or text, or read from a JSONL dataset in `mstar run --prompts`'s format. Arrivals: Poisson at
--request-rate requests/s (`inf`: all at once), or a closed loop of --concurrency clients; both
together cap the requests in flight. Every request streams (bench_serve_client.py). Prints a rich
table, or with --json one JSON object (bench_serve_report.py).

Exit status: 0 when the run finished (failed requests are counted in the figures); 1 for a bad
flag value or dataset, a server that cannot be reached or lists no model, or a run in which every
request failed; 2 for bad usage.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import urllib.parse
import random
import sys
import time
from typing import Any, Optional, Sequence

from mstar.arg_types import float_range, int_range, integer, path_arg, shown
from mstar.runtime.serve.bench_serve_requests import (
    ENDPOINTS, PROMPT_KINDS, BenchInputError, HttpRequest, generated_requests, read_dataset,
)

DEFAULT_CONCURRENCY = 8  # as `mstar run`'s closed loop
# seconds a request may take: aiohttp's timeout overflowed at inf (a 5000-digit --timeout read as
# inf: "OverflowError: cannot convert float infinity to integer", an internal error)
MAX_TIMEOUT_S = 86_400.0
log = logging.getLogger(__name__)


# the options that shape generated requests (a --dataset file holds its own)
GENERATOR_OPTIONS = ("requests", "prompt_len", "output_len", "prompt_kind", "endpoint")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True,
                        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)")
    parser.add_argument("--model", help="model name to send (default: the first that GET /v1/models lists)")
    parser.add_argument("--requests", type=int_range(1, 1_000_000), default=100,
                        help="generated requests (default 100)")
    parser.add_argument("--prompt-len", default="8..32", help="prompt length range A..B (default 8..32)")
    parser.add_argument("--output-len", default="32..64", help="max_tokens range A..B (default 32..64)")
    parser.add_argument("--prompt-kind", choices=PROMPT_KINDS, default="tokens",
                        help="tokens: token-id prompts (default); text: one word per generated token")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="completions",
                        help="/v1/completions (default) or /v1/chat/completions (text prompts)")
    parser.add_argument("--dataset", metavar="FILE", type=path_arg,
                        help="JSONL requests (mstar run --prompts format) instead")
    # inf (and a number past the float range, which reads as inf) sends every request at once
    parser.add_argument("--request-rate", type=float_range(0, math.inf, is_low_open=True), metavar="R",
                        help="Poisson arrivals at R requests/s (inf: all at once)")
    parser.add_argument("--concurrency", type=integer, metavar="C",
                        help=f"closed loop of C clients (default {DEFAULT_CONCURRENCY} without --request-rate); "
                             "with --request-rate: at most C requests in flight")
    parser.add_argument("--seed", type=integer, default=0, help="workload seed (default 0, as mstar run)")
    parser.add_argument("--extra-body", default="{}", metavar="JSON",
                        help='fields added to every request body, e.g. \'{"ignore_eos": true}\'')
    parser.add_argument("--timeout", type=float_range(0, MAX_TIMEOUT_S, is_low_open=True), default=600.0,
                        help=f"seconds per request (default 600, at most {MAX_TIMEOUT_S:.0f})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def _extra_body(text: str) -> dict[str, Any]:
    try:
        extra = json.loads(text)
    except ValueError as error:
        raise BenchInputError(f"--extra-body: not valid JSON ({error})") from None
    if not isinstance(extra, dict):
        raise BenchInputError(f"--extra-body: expected a JSON object, got {type(extra).__name__}")
    return extra


def _check_args(args: argparse.Namespace) -> None:
    if args.concurrency is not None and args.concurrency < 1:
        raise BenchInputError(f"--concurrency must be >= 1, got {shown(args.concurrency)}")
    if args.model is not None and not args.model.strip():  # as mstar serve refuses an empty name
        raise BenchInputError("--model needs a name (leave it out for the first that GET /v1/models lists)")
    if args.dataset is not None:  # the file holds the requests: options that shape generated ones would be ignored
        parser = _parser()
        given = ["--" + dest.replace("_", "-") for dest in GENERATOR_OPTIONS
                 if getattr(args, dest) != parser.get_default(dest)]
        if given:
            raise BenchInputError(f"{', '.join(given)}: options of generated requests; --dataset's file holds its "
                                  "own (leave them out)")
    extra = _extra_body(args.extra_body)
    if extra.get("stream", True) is not True:
        raise BenchInputError("--extra-body sets stream: the bench times streamed answers (first token, gaps)")
    if extra.get("n", 1) != 1:  # its choices' chunks interleave in one stream: their gaps are not a choice's
        raise BenchInputError("--extra-body sets n: the bench times one choice a request (its first token and gaps)")
    if args.dataset is None:
        from mstar.runtime.serve.workload import WorkloadError, parse_range

        try:
            parse_range(args.prompt_len, "--prompt-len")
            parse_range(args.output_len, "--output-len")
        except WorkloadError as error:
            raise BenchInputError(str(error)) from None
    if not args.base_url.startswith(("http://", "https://")):
        raise BenchInputError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    try:
        url = urllib.parse.urlsplit(args.base_url)
        _ = url.port  # a port past 65535 raises here
    except ValueError as error:
        raise BenchInputError(f"--base-url {args.base_url}: {error}") from None
    if not url.hostname:  # it failed at the first request: exit 1, "InvalidUrlClientError"
        raise BenchInputError(f"--base-url {args.base_url!r} names no host (e.g. http://127.0.0.1:8000)")
    # the OpenAI clients' base URL ends in /v1; the paths this sends start with it
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")


def _requests(args: argparse.Namespace) -> list[HttpRequest]:
    """The run's requests with their arrival offsets."""
    from mstar.runtime.serve.workload import WorkloadError, parse_range

    if args.dataset is None:
        try:
            prompt_len = parse_range(args.prompt_len, "--prompt-len")
            output_len = parse_range(args.output_len, "--output-len")
        except WorkloadError as error:
            raise BenchInputError(str(error)) from None
        return generated_requests(args.requests, prompt_len, output_len, seed=args.seed,
                                  prompt_kind=args.prompt_kind, endpoint=args.endpoint, rate=args.request_rate)
    requests = read_dataset(args.dataset)
    if args.request_rate is not None and math.isfinite(args.request_rate):
        rng, now = random.Random(args.seed), 0.0
        for request in requests:
            now += rng.expovariate(args.request_rate)
            request.arrival_s = now
    return requests


def _arrivals(args: argparse.Namespace) -> tuple[str, Optional[int]]:
    """(a description of the arrivals, the in-flight limit)."""
    if args.request_rate is None:
        concurrency = args.concurrency or DEFAULT_CONCURRENCY
        return f"closed loop, {concurrency} clients", concurrency
    rate = "all at once" if math.isinf(args.request_rate) else f"Poisson {args.request_rate:g}/s"
    cap = f", at most {args.concurrency} in flight" if args.concurrency else ""
    return rate + cap, args.concurrency


def _reason(error: BaseException) -> str:
    """What went wrong, never empty (a timeout's text is empty; an invalid URL's is the URL alone)."""
    if isinstance(error, asyncio.TimeoutError):
        return "no answer in time (--timeout, at most 30 s for the model list)"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _json_rate(rate: Optional[float]) -> Any:
    """The rate as JSON can hold it (JSON has no infinity)."""
    return "inf" if rate is not None and math.isinf(rate) else rate


async def _bench(args: argparse.Namespace, requests: list[HttpRequest], concurrency: Optional[int],
                 extra_body: dict[str, Any]) -> tuple[str, list[Any], float]:
    from mstar.runtime.serve.bench_serve_client import first_model, run_requests

    model = args.model or await first_model(args.base_url, min(args.timeout, 30.0))
    log.info("sending %d requests to %s (model %s)", len(requests), args.base_url, model)
    progress = None
    if sys.stderr.isatty() and not args.json:
        from tqdm import tqdm

        progress = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)
    started = time.perf_counter()
    results = await run_requests(requests, args.base_url, model, concurrency=concurrency, timeout_s=args.timeout,
                                 extra_body=extra_body,
                                 on_done=(lambda result: progress.update(1)) if progress else (lambda result: None))
    duration_s = time.perf_counter() - started
    if progress is not None:
        progress.close()
    return model, results, duration_s


def run(args: argparse.Namespace, extra_body: dict[str, Any]) -> int:
    """The bench, on options `main` checked (`_check_args`, `_extra_body`)."""
    import aiohttp

    from mstar.runtime.serve.bench_serve_client import StreamError
    from mstar.runtime.serve.bench_serve_report import render_table, summarize

    requests = _requests(args)
    arrivals, concurrency = _arrivals(args)
    try:
        model, results, duration_s = asyncio.run(_bench(args, requests, concurrency, extra_body))
    except (aiohttp.ClientError, asyncio.TimeoutError, StreamError) as error:
        raise BenchInputError(f"cannot reach a model at {args.base_url}: {_reason(error)}") from None
    settings = {"base_url": args.base_url, "model": model, "arrivals": arrivals, "concurrency": concurrency,
                "request_rate": _json_rate(args.request_rate), "dataset": args.dataset, "seed": args.seed}
    summary = summarize(results, duration_s, settings)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        from rich.console import Console

        Console().print(render_table(summary))
    if results and summary["num_completed"] == 0:
        print(f"mstar bench serve: error: every request failed (first: {results[0].error})", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        extra_body = _extra_body(args.extra_body)
    except BenchInputError as error:  # an option's value: exit 2 with the usage, as argparse's own checks
        parser.error(str(error))
    try:
        return run(args, extra_body)
    except BenchInputError as error:
        print(f"mstar bench serve: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mstar bench serve: interrupted", file=sys.stderr)
        return 130
