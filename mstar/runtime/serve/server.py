"""`mstar serve`: a compiled plan behind an OpenAI-compatible HTTP server (uvicorn + FastAPI).

    mstar serve --plan generated/llama.plan [--engine torch|sim] [--weights [NODE=]DIR ...]
                [--tokenizer DIR] [--host 127.0.0.1] [--port 8000] [--model NAME] ...

In: the options below. Out: a server (serve/http_app.py) until SIGTERM or SIGINT: then it stops
accepting connections, lets the requests in flight finish for at most `--drain-timeout` seconds
(uvicorn's graceful shutdown; those still running half a second before it ends are cancelled,
which frees their pages and ends their streams with a `cancelled` error event, and those a long
step keeps past the timeout are answered by closing the run loop, and bodies still arriving then
are answered 503; a second signal cancels them at once, a third is uvicorn's force exit), stops
the run loop and exits 0. Exit 1
with one `mstar serve: error: ...` line for a plan, tokenizer or engine that cannot start, or a
port that cannot be bound; 2 for bad usage.
"""
from __future__ import annotations

import argparse
import math
import re
import signal
import socket
import sys
import time
from typing import Any, Optional, Sequence

from mstar.arg_types import float_range, int_range, integer, path_arg, shown, weights_arg
from mstar.runtime.engine import gpu_switches
from mstar.runtime.serve.engine_setup import ENGINES, SEED_BOUND, SetupError, kv_pages_option_problem, torch_options_set

DRAIN_MARGIN_S = 0.5  # requests still in flight this long before the drain timeout are cancelled

DEFAULT_DRAIN_S = 30.0
# A drain of more than a day is no drain: inf was an internal error (graceful_timeout_s's ceil), and
# a finite 1e300 overflows the run loop's close (a thread join).
MAX_DRAIN_S = 86_400.0
# The sim engine sleeps pace x a step's modelled time: past this a millisecond step takes over a
# second, and a pace of 1e300 failed every request (time.sleep overflowed in the run loop).
MAX_SIM_PACE = 1000.0
MAX_WAITING = 10_000_000  # as many as `mstar run --requests` makes


def model_name(text: str) -> str:
    """argparse type of --model: an empty (or blank) name is a usage error; it was taken as absent,
    so the server went on serving the plan's name, which clients of the empty name never send."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty model name, got {text!r}")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar serve", description="Serve a compiled plan over an OpenAI-compatible "
                                                               "HTTP API.")
    p.add_argument("--plan", required=True, type=path_arg, help="compiled plan (generated/<config>.plan)")
    p.add_argument("--engine", choices=ENGINES, default="torch",
                   help="torch: the models (default); sim: the cost model, taking its modelled time in wall time")
    p.add_argument("--weights", action="append", type=weights_arg, metavar="[NODE=]DIR",
                   help="checkpoint directory (as mstar run)")
    p.add_argument("--tokenizer", metavar="DIR", type=path_arg, help="directory with tokenizer.json (as mstar run)")
    p.add_argument("--dims", choices=("tiny", "spec"), default="tiny", help="torch engine model dims (default tiny)")
    # --kv-pages and --port keep their range checks in _check, exit status 1: --kv-pages's is mstar run's,
    # and --port's runs before the socket is bound
    p.add_argument("--kv-pages", type=integer, help="KV pool pages per kv node (overrides the plan)")
    p.add_argument("--device", default="cpu", help="torch engine: cpu or cuda[:N]")
    p.add_argument("--attention", choices=("auto", "torch", "flashinfer"), default="auto")
    p.add_argument("--seed", type=int_range(-SEED_BOUND, SEED_BOUND), default=0,
                   help="engine seed (random weights; within +-2**43, as mstar run)")
    gpu_switches.add_arguments(p)  # --no-blas-pdl, --nucleus, --penalties, as mstar run's
    p.add_argument("--sim-pace", type=float_range(0, MAX_SIM_PACE), default=1.0,
                   help=f"sim engine: wall seconds per modelled second, in [0, {MAX_SIM_PACE:g}] (default 1; 0: as "
                        "fast as the host goes)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_range(0, 65535), default=8000,
                   help="port, 0..65535 (default 8000; 0: one the system picks)")
    p.add_argument("--model", type=model_name, help="the model name clients send (default: the plan's model name)")
    p.add_argument("--max-waiting", type=int_range(0, MAX_WAITING), default=256,
                   help="requests that may wait beyond the plan's max_concurrent_requests before 429 "
                        f"(0..{MAX_WAITING}, default 256)")
    p.add_argument("--drain-timeout", type=float_range(0, MAX_DRAIN_S), default=DEFAULT_DRAIN_S,
                   help=f"seconds in-flight requests get to finish after SIGTERM, in [0, {MAX_DRAIN_S:g}] "
                        f"(default {DEFAULT_DRAIN_S:.0f})")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--cors-origin", action="append", default=[], type=cors_origin, metavar="ORIGIN",
                   help="a browser origin allowed to call the API (scheme://host[:port], repeatable; '*': any); "
                        "default: none, no CORS headers")
    return p


def cors_origin(text: str) -> str:
    """argparse type of --cors-origin: `*` or scheme://host[:port] with no path (a browser's Origin
    header never has one, so an origin with a path would match no request, silently)."""
    if text == "*" or re.fullmatch(r"https?://[^/\s?#]+", text):
        return text
    raise argparse.ArgumentTypeError(f"must be '*' or an origin such as http://localhost:3000 (scheme://host[:port], "
                                     f"no path), got {shown(text)}")


def _check(args: argparse.Namespace) -> None:
    _check_port(args.port)
    problem = kv_pages_option_problem(args.kv_pages)  # mstar run's words
    if problem is not None:
        raise SetupError(problem)
    switches_problem = gpu_switches.off_gpu_problem(args, args.engine == "torch" and args.device.startswith("cuda"))
    if switches_problem is not None:
        raise SetupError(switches_problem)
    torch_only = torch_options_set(args.device, args.dims, args.attention)
    if args.engine == "sim" and torch_only:
        raise SetupError(f"{', '.join(torch_only)}: options of the torch engine; this server runs --engine sim")
    if args.engine != "sim" and args.sim_pace != 1.0:
        raise SetupError(f"--sim-pace paces the sim engine; this server runs --engine {args.engine}")


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:  # before the socket: a negative port read as a host that does not resolve
        raise SetupError(f"--port must be in 0..65535, got {shown(port)}")


def build(args: argparse.Namespace) -> Any:
    """The app's Service (serve/http_app.py) from parsed options; SetupError when it cannot start."""
    from mstar.runtime.serve.api import LLM
    from mstar.runtime.serve.http_app import Service
    from mstar.runtime.serve.prom import ServerMetrics

    _check(args)
    # before any graph is captured (process-wide, as the modules' switches are)
    gpu_switches.apply(False if args.no_blas_pdl else None, args.nucleus, args.penalties)
    metrics = ServerMetrics()
    llm = LLM(args.plan, engine=args.engine, weights=args.weights, tokenizer=args.tokenizer, dims=args.dims,
              kv_pages=args.kv_pages, device=args.device, attention=args.attention, seed=args.seed,
              sim_pace=args.sim_pace, max_waiting=args.max_waiting, observer=metrics)
    return Service(llm, llm.plan.header.model if args.model is None else args.model, metrics, args.cors_origin)


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket uvicorn serves on, bound here first: a port in use or a host that does not
    resolve is one error line before the plan is loaded (uvicorn's own bind printed its log line
    and exited 3)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise SetupError(f"--host {host!r} does not resolve: {getattr(error, 'strerror', None) or error}") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise SetupError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listener


def _drain_times(drain_s: float) -> tuple[float, float]:
    """(when the drain cancels the requests in flight, when it closes the run loop without waiting
    for a step), in seconds after the shutdown began: a cancelled request ends at the next step
    boundary, which a long step (a long prefill, a diffusion step) puts past the drain's end."""
    cancel_s = max(0.0, drain_s - DRAIN_MARGIN_S)
    return cancel_s, cancel_s + DRAIN_MARGIN_S


def graceful_timeout_s(drain_s: float) -> int:
    """uvicorn's own drain timeout, which cancels the handlers still running (their streams cut, a
    plain-text 500, CancelledError tracebacks): only once the run loop's close has answered them
    (online.STOP_GRACE_S after the close at the latest), a second later."""
    from mstar.runtime.serve.online import STOP_GRACE_S

    return math.ceil(_drain_times(drain_s)[1] + STOP_GRACE_S) + 1


def _draining_server(config: Any, loop: Any, drain_s: float, uploads: Any = None) -> Any:
    """uvicorn's server, whose shutdown cancels the requests still in flight shortly before the
    drain timeout: they end `cancelled` (a stream with its error event and [DONE]) where uvicorn's
    own timeout cancelled their handlers, cutting the streams and logging CancelledError tracebacks.
    Those a long step keeps past the timeout are answered then by closing the run loop without
    waiting for the step (`OnlineLoop.close(0)`: the stream's error event, a JSON 500); before,
    uvicorn's timeout cut them as above. Bodies still arriving then (`uploads`, serve/upload_cut.py)
    are cut with them: a JSON 503, where uvicorn's timeout answered a plain-text 500 and logged a
    traceback. (uvicorn is imported here: `import mstar` stays light.)"""
    import asyncio

    import uvicorn

    def cancel_all() -> None:
        loop.cancel_all()
        if uploads is not None:
            uploads.cut()

    class DrainingServer(uvicorn.Server):
        is_cancelling = False
        drain_started_s: Optional[float] = None  # time.monotonic() when the shutdown began

        def drain_left_s(self) -> float:
            """What is left of the drain timeout (all of it before a shutdown began): `serve` closes
            the run loop with it, where it waited a whole timeout again on a step still running
            (a 5 s drain returned after 11 s)."""
            if self.drain_started_s is None:
                return drain_s
            return max(0.0, drain_s - (time.monotonic() - self.drain_started_s))

        def handle_exit(self, sig: int, frame: Any) -> None:
            """A second signal while draining (Ctrl-C twice) cancels every request now, so each
            answers `cancelled` and the drain ends when they have; uvicorn's own force exit cut
            the streams, answered a plain-text 500 and logged CancelledError tracebacks. A third
            signal is uvicorn's force exit."""
            if self.should_exit and not self.is_cancelling:
                self.is_cancelling = True
                cancel_all()
                return
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and sockets:
                _say_listening(sockets[0])

        async def shutdown(self, sockets: Any = None) -> None:
            self.drain_started_s = time.monotonic()
            event_loop = asyncio.get_running_loop()
            cancel_s, close_s = _drain_times(drain_s)
            timers = [event_loop.call_later(cancel_s, cancel_all),
                      event_loop.call_later(close_s, lambda: event_loop.run_in_executor(None, loop.close, 0.0))]
            try:
                await super().shutdown(sockets)
            finally:
                for timer in timers:
                    timer.cancel()

    return DrainingServer(config)


def _say_listening(listener: socket.socket) -> None:
    """uvicorn's "Uvicorn running on http://HOST:PORT" line, which it writes only for a socket it
    binds itself: `serve` binds it first (a port in use is one error line), so nothing said where the
    server listened, nor which port `--port 0` had taken."""
    import logging

    host, port = listener.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", shown_host, port)


def serve(service: Any, listener: socket.socket, drain_s: float, log_level: str = "info") -> int:
    """Run uvicorn on `listener` until a signal; the run loop stops after uvicorn drained. Exit status."""
    import uvicorn

    from mstar.runtime.serve.http_app import build_app

    host, port = listener.getsockname()[:2]
    config = uvicorn.Config(build_app(service), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout_s(drain_s), lifespan="off")
    server = _draining_server(config, service.llm.loop, drain_s, service.uploads)
    noted: list[int] = []
    # uvicorn restores the handlers it found and raises the signal again once it has shut down:
    # these note it, so a drained server exits 0 instead of dying by the signal.
    previous = {signum: signal.signal(signum, lambda s, _: noted.append(s))
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[listener])
    except SystemExit as stop:  # uvicorn exits when it cannot serve (the socket is bound already)
        service.llm.close(0)
        return int(stop.code or 1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    service.llm.close(server.drain_left_s())
    return 0 if server.started else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        _check_port(args.port)
        listener = listening_socket(args.host, args.port)
    except SetupError as error:
        print(f"mstar serve: error: {error}", file=sys.stderr)
        return 1
    try:
        service = build(args)
    except SetupError as error:
        listener.close()
        print(f"mstar serve: error: {error}", file=sys.stderr)
        return 1
    return serve(service, listener, args.drain_timeout, args.log_level)
