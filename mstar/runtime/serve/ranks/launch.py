"""Start one process per rank (or join a `torchrun` launch) and tear every one of them down.

In: the plan (and its path: each process loads and verifies it itself), `RankOptions`. Out:
`RankProcesses`, a context manager whose `engine` is rank 0's `RankEngines` for the run loop.

- `mstar run` (spawn): this process is rank 0; ranks 1..N-1 are `torch.multiprocessing` spawn
  children. Rendezvous through a TCPStore that rank 0 opens on 127.0.0.1 (a free port); each child
  announces itself in the store before `init_process_group`, so a child that dies while starting
  is noticed (rank 0 polls the store and the children's exit codes) instead of waited for.
  Children die with their parent (Linux `PR_SET_PDEATHSIG`), ignore SIGINT, SIGTERM and SIGHUP
  (sent to the whole process group by Ctrl-C, a closed terminal or a service stop: rank 0 stops
  them in order), and are asked to exit, then killed, when the run ends however it ends.
- `torchrun` (env:// rendezvous, RANK, WORLD_SIZE, LOCAL_RANK): each process runs `mstar run` with
  the same arguments; rank 0 becomes the controller, the others serve it (worker.py) and exit when
  it stops. torchrun's agent watches the processes on each host.

Process groups: the world group is gloo (control messages and KV pages travel through host
memory); one group per TP instance of the plan (`WorkerPlan.tp_groups`, through
`engine/tp/build.tp_comms`: every rank creates every group in the same order), gloo on the CPU and
NCCL on GPUs; each rank's engine builds its TP nodes as its own shard (`engine/tp/`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from mstar.plan.io import load_plan
from mstar.plan.schema import Plan
from mstar.runtime.engine.tp.build import tp_comms
from mstar.runtime.serve.ranks.channel import Channel, RankFailure
from mstar.runtime.serve.ranks.controller import RankEngines
from mstar.runtime.serve.ranks.worker import RankOptions, build_executor, serve

GROUP_TIMEOUT = timedelta(hours=2)  # hangs are the rank timeout's to catch, not gloo's
START_TIMEOUT_S = 600.0  # building a rank's models at spec dims takes a while
RENDEZVOUS_POLL_S = 0.2  # how often the main thread looks up from a torchrun rendezvous (signals run then)
PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """The ranks could not be started (the message names the rank and why)."""


def world_size(plan: Plan) -> int:
    return max(worker.rank for worker in plan.workers) + 1


def rank_device(device: str, local_rank: int) -> str:
    """`cuda` gives each rank its own GPU (cuda:LOCAL_RANK); `cpu` stays."""
    if device.startswith("cuda"):
        if ":" in device:
            raise LaunchError(f"--device {device} names one GPU; with several ranks each rank takes "
                              "cuda:LOCAL_RANK: pass --device cuda")
        return f"cuda:{local_rank}"
    return device


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's cleanup still kills us
        pass


def child_main(plan_path: str, rank: int, size: int, port: int, parent: int, options: RankOptions) -> None:
    """A spawned rank: announce, join the groups, build the engine, serve rank 0, exit."""
    _die_with_parent()
    # The parent owns the run's end: an interrupt, a closed terminal or a service stop reaches the
    # whole process group, and the parent stops its ranks after the step in progress and writes
    # the report; a rank that died of the signal first would fail that step's requests instead.
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if os.getppid() != parent:
        os._exit(1)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=START_TIMEOUT_S))
    plan = load_or_tell(plan_path, rank, store)
    store.set(f"mstar/hello/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    run_rank(plan, rank, rank, options, lambda peer: None if os.getppid() == parent else "is gone")
    dist.destroy_process_group()


def load_or_tell(plan_path: str, rank: int, store: Any) -> Plan:
    """The spawned rank's plan; one it cannot load (the file changed since rank 0 read it: a
    recompile while the run starts) is told to rank 0 through the store, which names it (`_spawn`),
    and the rank exits with no traceback of its own."""
    try:
        return load_plan(plan_path)
    except Exception as error:
        store.set(f"mstar/fatal/{rank}", f"cannot load the plan: {' '.join(str(error).split())}")
        raise SystemExit(1) from None


def run_rank(plan: Plan, rank: int, local_rank: int, options: RankOptions, peer_problem: Any) -> None:
    """Ranks other than 0: groups, engine, the ready message, then the command loop."""
    device = rank_device(options.device, local_rank)
    channel = Channel(peer_problem)
    # what this rank loaded and runs with, before any group or model is built (`_await_hello`)
    try:
        channel.send(0, "hello", {"plan": plan.header.content_sha256, "options": options.shared()})
    except RankFailure:  # rank 0 is gone: it reports the run's end itself
        raise SystemExit(1) from None
    try:
        # (its groups too: a plan's refused sp_size raised here, outside the try, as a traceback)
        comms = tp_comms(plan, rank, "nccl" if device.startswith("cuda") else "gloo", options.timeout_s)
        executor = build_executor(plan, rank, options, channel, device, comms)
    except Exception as error:  # a refused engine: rank 0 reports it and stops
        try:
            channel.send(0, "fatal", {"message": f"cannot start its engine: {_first_line(error)}"}, timeout_s=10.0)
        except RankFailure:  # rank 0 is still building its own engine: it sees this rank exit instead
            raise SystemExit(1) from None
        return
    channel.send(0, "ready", {"memory": executor.memory()})
    serve(executor, channel, rank)


def _check_gpus(device: str, size: int) -> None:
    """Spawned ranks take one GPU each (`rank_device`): refuse a run this machine cannot place
    before any rank builds its models, rather than after rank 0 has built its own."""
    if not device.startswith("cuda"):
        return
    available = torch.cuda.device_count()
    if available < size:
        raise LaunchError(f"the plan runs {size} ranks, one GPU each with --device cuda (rank r on cuda:r); "
                          f"this machine has {available} (--ranks inproc runs every rank in this process, on one GPU)")


class RankProcesses:
    """Rank 0's side of a multi-process run (a context manager; see the module docstring)."""

    def __init__(self, plan_path: str, plan: Plan, options: RankOptions, is_torchrun: bool = False):
        self.plan_path, self.plan, self.options = plan_path, plan, options
        self.is_torchrun = is_torchrun
        self.size = world_size(plan)
        self.children: dict[int, Any] = {}
        self.engine: Optional[RankEngines] = None

    def problem(self, rank: int) -> Optional[str]:
        """Why a spawned rank is gone, or None while it runs (torchrun: its agent watches)."""
        child = self.children.get(rank)
        if child is None or child.exitcode is None:
            return None
        if child.exitcode < 0:
            return f"was killed by {signal.Signals(-child.exitcode).name}"
        return f"exited with code {child.exitcode}"

    def __enter__(self) -> "RankProcesses":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        if self.is_torchrun:
            join_env_group()
        else:
            self._spawn()
        device = rank_device(self.options.device, int(os.environ.get("LOCAL_RANK", "0")))
        channel = Channel(self.problem)
        for rank in range(1, self.size):
            self._await_hello(channel, rank)
        comms = tp_comms(self.plan, 0, "nccl" if device.startswith("cuda") else "gloo", self.options.timeout_s)
        local = build_executor(self.plan, 0, self.options, channel, device, comms) if 0 in self._ranks() else None
        self.engine = RankEngines(self.plan, local, channel, self.size, self.options.timeout_s)
        if local is not None:
            self.engine.memory[0] = local.memory()
        for rank in range(1, self.size):
            self._await_ready(channel, rank)

    def _ranks(self) -> set[int]:
        return {worker.rank for worker in self.plan.workers}

    def _spawn(self) -> None:
        _check_gpus(self.options.device, self.size)
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        context = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.size):
            child = context.Process(target=child_main, daemon=True, name=f"mstar-rank-{rank}",
                                    args=(self.plan_path, rank, self.size, store.port, os.getpid(), self.options))
            child.start()
            self.children[rank] = child
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank in range(1, self.size):
            while not _has_key(store, f"mstar/hello/{rank}"):
                problem = self.problem(rank)
                if problem is not None:
                    if store.check([f"mstar/fatal/{rank}"]):
                        raise LaunchError(f"rank {rank} {store.get(f'mstar/fatal/{rank}').decode()}")
                    raise LaunchError(f"rank {rank} {problem} while starting")
                if time.monotonic() > deadline:
                    raise LaunchError(f"rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
        dist.init_process_group("gloo", store=store, rank=0, world_size=self.size, timeout=GROUP_TIMEOUT)

    def _await_hello(self, channel: Channel, rank: int) -> None:
        """The plan and the options the rank runs with are rank 0's (torchrun starts each rank
        with its own command line), checked before any rank builds a group or a model."""
        message = self._start_message(channel, rank, "loading the plan")
        if message.body.get("plan") != self.plan.header.content_sha256:
            raise LaunchError(f"rank {rank} loaded another plan than rank 0 (content hash "
                              f"{message.body.get('plan')} vs {self.plan.header.content_sha256}); every "
                              "rank must run the same plan file")
        theirs, ours = message.body.get("options") or {}, self.options.shared()
        differing = [f"{key} {theirs.get(key)!r} against {value!r}" for key, value in ours.items()
                     if theirs.get(key) != value]
        if differing:
            raise LaunchError(f"rank {rank} runs with other engine options than rank 0 ({'; '.join(differing)}); "
                              "every rank must run the same options (--dims, --seed, --kv-pages, --attention, "
                              "--device, --weights or none, --no-blas-pdl)")

    def _await_ready(self, channel: Channel, rank: int) -> None:
        message = self._start_message(channel, rank, "building its engine")
        assert self.engine is not None
        self.engine.memory[rank] = message.body["memory"]

    def _start_message(self, channel: Channel, rank: int, what: str) -> Any:
        try:
            message = channel.recv(rank, timeout_s=START_TIMEOUT_S, what=what)
        except RankFailure as failure:
            raise LaunchError(f"rank {rank} {failure.reason} while starting") from None
        if message.kind == "fatal":
            raise LaunchError(f"rank {rank} {message.body['message']}")
        return message

    def close(self) -> None:
        """Stop every rank: ask (a run that ended well), then kill; leave the process group. Ranks
        of a run abandoned mid-step (`RankEngines.abandon`) or with a step's answer still due are
        killed at once: one blocked sending that answer took no ask (2 s), then no join (5 s)."""
        is_mid_step = self.engine is not None and (self.engine.is_abandoned or bool(self.engine.running))
        if self.engine is not None and self.engine.lost is None and not is_mid_step:
            self.engine.stop()
            for child in self.children.values():
                child.join(timeout=5.0)
        for child in self.children.values():
            if child.exitcode is None:  # a rank ignores SIGTERM (child_main): kill it
                child.kill()
                child.join()
        if dist.is_initialized() and not is_mid_step:  # (mid-step: the command exits without teardown)
            dist.destroy_process_group()


def serve_torchrun(plan: Plan, options: RankOptions) -> None:
    """A rank other than 0 of a torchrun launch: serve rank 0 until it stops. Rank 0 gone (killed,
    or stopped refusing this rank) is a LaunchError naming it, not an internal error."""
    join_env_group()
    try:
        run_rank(plan, dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), options, lambda peer: None)
    except (RankFailure, dist.DistError) as error:
        raise LaunchError(f"rank 0 is gone, so this rank stops ({_first_line(error)})") from None
    finally:
        dist.destroy_process_group()


def join_env_group() -> None:
    """The world group of a torchrun launch (env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
    its rendezvous bounded by START_TIMEOUT_S and waited for on a helper thread: `init_method=env://`
    gave the rendezvous the group's 2-hour timeout, so a wrong port or a rank that never came waited
    2 hours inside C++, where neither Ctrl-C nor SIGTERM reached Python."""
    found: list[Any] = []

    def rendezvous() -> None:
        try:
            found.append(next(dist.rendezvous("env://", timeout=timedelta(seconds=START_TIMEOUT_S))))
        except Exception as error:  # (a timeout, a refused address: said below)
            found.append(error)

    thread = threading.Thread(target=rendezvous, name="mstar-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():  # (the main thread takes signals between polls)
        thread.join(RENDEZVOUS_POLL_S)
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if isinstance(found[0], Exception):
        raise LaunchError(f"the torchrun rendezvous at {where} did not complete within {START_TIMEOUT_S:.0f} s "
                          f"or failed ({_first_line(found[0])[:300]})")
    store, rank, size = found[0]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)


def _first_line(error: BaseException) -> str:
    """An error's first line, its spaces collapsed, for a one-line message (a torch error's text
    carries its C++ frames after it); its type's name where it has no text (an empty message made
    `splitlines()[0]` raise IndexError where rank 0's loss was said)."""
    lines = str(error).splitlines()
    return " ".join(lines[0].split()) if lines else type(error).__name__


def _has_key(store: Any, key: str) -> bool:
    if store.check([key]):
        return True
    time.sleep(0.05)
    return False
