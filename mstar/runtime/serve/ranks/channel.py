"""Point-to-point messages between rank processes over torch.distributed send/recv.

In: a message kind, a JSON-able body and tensors (wire.py makes the body plain data). Out, on the
peer: the same `Message`. On the wire a message is two sends on the world group: an int64 pair
(header bytes, tensor bytes), then one uint8 buffer holding the JSON header (kind, body, each
tensor's dtype and shape) followed by every tensor's bytes. Tensors travel as raw bytes, so any
dtype (bool, bf16) crosses a gloo group, and a message is two transfers whatever it holds.

Waiting never blocks blindly: a send or receive is posted asynchronously and waited for on a
helper thread, while the caller checks every 20 ms whether the peer is gone (`peer_problem(rank)`:
a process that exited) and whether the deadline passed (a hang). A transport error (gloo: the
peer's process ended and closed its connection, on this host or another), a gone peer or a passed
deadline ends the wait with `RankFailure` naming the rank.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mstar.runtime.step import EngineLost

PeerProblem = Callable[[int], Optional[str]]  # rank -> why it is gone, or None while it lives
LIVENESS_EVERY_S = 0.02
# A killed process's connections reset before its exit can be seen (the parent reaps it a moment
# later): a transport failure waits this long for the peer's own reason before naming the reset.
EXIT_SEEN_WITHIN_S = 1.0


class RankFailure(EngineLost):
    """A rank exited, hung or answered with an error: the run cannot go on."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} {reason}")
        self.rank = rank
        self.reason = reason
        self.is_final = False  # the controller has named the rank's last step in `reason`


@dataclass
class Message:
    kind: str
    body: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)


def _no_problem(rank: int) -> Optional[str]:
    return None


class Channel:
    def __init__(self, peer_problem: PeerProblem = _no_problem, group: Any = None):
        self.peer_problem = peer_problem
        self.group = group
        self.waiter = _Waiter()

    def send(self, dst: int, kind: str, body: dict[str, Any], tensors: Optional[list[torch.Tensor]] = None,
             timeout_s: Optional[float] = None) -> None:
        parts = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors or []]
        specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors or []]
        header = json.dumps({"kind": kind, "body": body, "tensors": specs}).encode("utf-8")
        payload = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8)] + parts)
        sizes = torch.tensor([len(header), payload.numel() - len(header)], dtype=torch.int64)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._wait(self._post(dist.isend, sizes, dst), dst, deadline, "taking a message")
        self._wait(self._post(dist.isend, payload, dst), dst, deadline, "taking a message")

    def recv(self, src: int, timeout_s: Optional[float] = None, what: str = "answering") -> Message:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sizes = torch.zeros(2, dtype=torch.int64)
        self._wait(self._post(dist.irecv, sizes, src), src, deadline, what)
        num_header, num_data = int(sizes[0]), int(sizes[1])
        payload = torch.empty(num_header + num_data, dtype=torch.uint8)
        self._wait(self._post(dist.irecv, payload, src), src, deadline, what)
        header = json.loads(bytes(payload[:num_header].numpy()).decode("utf-8"))
        return Message(header["kind"], header["body"], _split(payload[num_header:], header["tensors"]))

    def _post(self, operation: Callable[..., Any], tensor: torch.Tensor, peer: int) -> Any:
        """Post an isend/irecv; a transport that already failed (gloo: the peer closed its
        connection) is the peer's failure."""
        try:
            return operation(tensor, peer, group=self.group)
        except RuntimeError as error:
            raise RankFailure(peer, self._why_gone(peer, error)) from None

    def _why_gone(self, peer: int, error: BaseException) -> str:
        deadline = time.monotonic() + EXIT_SEEN_WITHIN_S
        problem = self.peer_problem(peer)
        while problem is None and time.monotonic() < deadline:
            time.sleep(LIVENESS_EVERY_S)
            problem = self.peer_problem(peer)
        return problem or f"closed its connection ({str(error).splitlines()[0][:200]})"

    def _wait(self, work: Any, peer: int, deadline: Optional[float], what: str) -> None:
        """Wait for `work` on the waiter thread; RankFailure when it fails (gloo: the peer closed
        its connection), when the peer is gone, or when the deadline passes."""
        done = self.waiter.start(work)
        while not done.event.wait(LIVENESS_EVERY_S):
            problem = self.peer_problem(peer)
            if problem is not None:
                raise RankFailure(peer, problem)
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailure(peer, f"hangs: no progress {what} within the rank timeout")
        if done.error is not None:
            raise RankFailure(peer, self._why_gone(peer, done.error))


class _Done:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: Optional[BaseException] = None


class _Waiter:
    """One daemon thread that blocks in `work.wait()` (which releases the GIL) so the caller can
    keep checking its peer. gloo's own timed wait closes the connection when it times out, and its
    `is_completed` only turns true inside `wait`, so neither can be polled. A wait abandoned on a
    failure stays on this thread; the run is over then, and a daemon thread does not hold up exit."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None

    def start(self, work: Any) -> _Done:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="mstar-rank-waiter", daemon=True)
            self.thread.start()
        done = _Done()
        self.queue.put((work, done))
        return done

    def _loop(self) -> None:
        while True:
            work, done = self.queue.get()
            try:
                work.wait()
            except Exception as error:  # the transport failed (a closed connection): the caller reports it
                done.error = error
            done.event.set()


def _split(data: torch.Tensor, specs: list[list[Any]]) -> list[torch.Tensor]:
    """The message's tensors, each viewed back from its bytes (dtype and shape from the header)."""
    tensors, start = [], 0
    for dtype_name, shape in specs:
        dtype = getattr(torch, dtype_name)
        num_bytes = dtype.itemsize * int(torch.Size(shape).numel())
        chunk = data[start:start + num_bytes].clone()
        tensors.append(chunk.view(dtype).reshape(shape))
        start += num_bytes
    return tensors
