"""The online run loop: requests arrive at any time, outputs leave step by step.

In: a plan, an engine and, optionally, a tokenizer (`decode` for text deltas and stop strings).
Out: per request, a stream of `Delta`s handed to the request's `deliver` callback as each step
that produced something finishes, the last one carrying the finish reason.

    loop = OnlineLoop(plan, engine, decode=tokenizer.decode, max_waiting=256)
    loop.start()                                   # the driver runs on its own thread
    loop.submit(request, deliver)                  # any thread; Overloaded / Closed when refused
    loop.cancel(request_id)                        # any thread; ends it at the next step boundary
    loop.close(timeout_s)                          # no new requests; in-flight ones finish first

The loop is the ordinary run loop (`Driver.run_source`, driver.py) with this object as its
source: submissions and cancellations wait in a thread-safe inbox that the driver empties at the
top of each iteration; with nothing in flight the driver blocks on the inbox's event (no
spinning). Per-step delivery is the driver's `on_step` hook: each request with a row in the step
gets the client emissions it made since its last delta (text emissions as token ids and text;
audio and image emissions as values, in order). A request that ends gets its final delta from
`on_finish` (cancelled, failed, refused by the engine, or done), and its record leaves the
conductor, so a long-running server keeps no finished request.

Admission: the conductor admits `max_concurrent_requests` (the plan's deployment) at once and the
rest wait in its FIFO queue; this loop bounds that queue: with `max_concurrent + max_waiting`
requests in flight a new one is refused (`Overloaded`). A plan without max_concurrent_requests
admits everything at once (the KV pool's admission then holds rows), and nothing is refused.

Cancellation goes through the same inbox: the driver calls `conductor.cancel`, which ends the
request, has the engine free its KV pages and state slots, and removes its rows from the
schedulers; rows of it already in a built step are left out of that step. Nothing else changes.

`deliver` is called on the driver's thread: it must be quick and must not block (the server's
hands the delta to its event loop with `call_soon_threadsafe`). Observers (`Observer`) see first
tokens, gaps between deltas, endings and steps, for metrics.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from mstar.plan.schema import Plan
from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.conductor.request import Request, RequestRecord, token_ids_of
from mstar.runtime.conductor.text_context import prompt_context
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.steps import Launch
from mstar.runtime.serve.text_stream import TextStream
from mstar.runtime.step import Engine

log = logging.getLogger(__name__)

# close(timeout): after the timeout the driver stops at the step boundary; a step still running this
# much later is not waited for (a hung step held close, and the interpreter's exit, for ever)
STOP_GRACE_S = 0.5


class Overloaded(Exception):
    """Too many requests in flight: the admission queue is full (HTTP 429)."""


class Closed(Exception):
    """The loop no longer takes requests (shutting down, or its driver failed)."""


@dataclass(slots=True)
class Delta:
    """What one request produced since its previous delta. The last delta of a request has
    `finish_reason` set (the conductor's: stop, length, cancelled, error: ...)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)  # text emissions' token ids
    text: str = ""  # their text ('' without a tokenizer)
    media: list[tuple[str, Any]] = field(default_factory=list)  # (modality, value), in order
    finish_reason: Optional[str] = None
    is_refused: bool = False  # the engine or the route refused it at admission (nothing ran)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # counted output tokens so far
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (the conductor's count)
    is_input_fault: bool = False  # it failed mid-run on its own input (RequestRecord.is_input_fault)
    # one per token of token_ids, for a request that asked for them (Request.logprobs): its
    # TokenLogprobs (step.py), None for a token no row answered them of; None for other requests
    logprobs: Optional[list[Any]] = None
    # on a request's first delta, where it asked for them (Request.prompt_logprobs): one per prompt
    # token (RequestRecord.prompt_logprobs; None for the first token and any the engine gave none of)
    prompt_logprobs: Optional[list[Any]] = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


class Observer:
    """Hooks for metrics; every method is called on the driver's thread. The base does nothing."""

    def on_first_output(self, seconds: float) -> None:
        """Time from submission to a request's first delivered output."""

    def on_output_gap(self, seconds: float) -> None:
        """Time between two successive outputs of one request."""

    def on_finish(self, finish_reason: str, is_refused: bool = False, is_input_fault: bool = False) -> None:
        """A request ended with this reason (is_refused: at admission, nothing ran; is_input_fault:
        mid-run, on its own input)."""

    def on_step(self, key: str, mixture: str) -> None:
        """A step of this scheduling key and mixture (its walks, `+`-joined) finished."""

    def on_prefix_lookups(self, num_lookups: int, num_cached_tokens: int) -> None:
        """An ended request's prefix-cache lookups (one per kv node whose plan caches prefixes and
        that took its prompt) and the prompt tokens they found cached; called only when it looked."""


OBSERVER_HOOKS = ("on_first_output", "on_output_gap", "on_finish", "on_step", "on_prefix_lookups")


class _Guarded(Observer):
    """A caller's observer whose raises are logged (once a hook) and go no further: a hook that
    raised on the driver's thread stopped the run loop before it answered its clients, and a
    `generate` waiting on them never returned."""

    def __init__(self, inner: Observer):
        self.inner = inner
        self.failed: set[str] = set()
        for name in OBSERVER_HOOKS:
            setattr(self, name, self._guard(name, getattr(inner, name)))

    def _guard(self, name: str, hook: Callable[..., None]) -> Callable[..., None]:
        def guarded(*args: Any) -> None:
            try:
                hook(*args)
            except Exception as error:
                if name not in self.failed:
                    self.failed.add(name)
                    log.error("the observer's %s raised (%s: %s); the requests go on (logged once)",
                              name, type(error).__name__, error)
        return guarded


class _Tracked:
    """A request in flight, as the driver thread sees it."""

    __slots__ = ("request", "deliver", "cursor", "text", "submit_s", "last_output_s", "is_started", "is_body_refused")

    def __init__(self, request: Request, deliver: Callable[[Delta], None], text: Optional[TextStream],
                 submit_s: float):
        self.request = request
        self.deliver = deliver
        self.cursor = 0  # emissions already delivered
        self.text = text
        self.submit_s = submit_s  # time.monotonic() when `submit` queued it (not when the driver took it)
        self.last_output_s: Optional[float] = None
        self.is_started = False  # admitted by the conductor (or ended)
        self.is_body_refused = False  # cancelled because its body was refused (`cancel_refused`): counted so


class OnlineLoop:
    """See the module docstring."""

    def __init__(self, plan: Plan, engine: Engine, *, decode: Optional[Callable[[list[int]], str]] = None,
                 max_waiting: int = 256, observer: Optional[Observer] = None):
        self.plan = plan
        self.engine = engine
        self.decode = decode
        self.observer = Observer() if observer is None else _Guarded(observer)
        self.driver = Driver(plan, engine, on_finish=self._on_finish, decode=decode, on_step=self._on_step,
                             log=_NoLog())
        max_concurrent = plan.deployment.max_concurrent_requests
        self.max_in_flight = None if max_concurrent is None else max_concurrent + max_waiting
        self._inbox: deque[tuple[str, Any]] = deque()
        # Submissions put in the inbox (under the lock) and taken out of it (by the thread emptying
        # it): their difference is the requests waiting there, which the inbox's length overstated
        # by its cancel messages. Two counts, each written by one side, so taking needs no lock.
        self._num_put = 0
        self._num_taken = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._reserved: set[str] = set()  # request ids a body reserved room for (`reserve`), not yet submitted
        self._tracked: dict[str, _Tracked] = {}  # driver thread only
        # Submitted, not yet seen admitted, in submission order (driver thread only): the conductor
        # admits FIFO, so only a prefix of it can have started since the last look.
        self._unstarted: deque[str] = deque()
        self._mixtures = {(key.name, m.mask): "+".join(m.walks) for w in plan.workers for key in w.keys
                          for m in key.mixtures}
        self.is_closed = False
        self.error: Optional[str] = None  # why the driver thread died, if it did
        # who its refusals and cut-off requests name: the Python API's LLM, or the HTTP server that
        # serves one (its Service sets this); the API said "the server is shutting down" of an LLM
        self.owner = "the LLM"
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mstar-run-loop", daemon=True)
        self._thread.start()

    def reserve(self, request_ids: Sequence[str]) -> None:
        """Room for several requests at once (a body's n choices or prompts), or Overloaded for all
        of them: the first choices ran, their TTFT counted, then a later one was refused and they
        were cancelled (an extra `cancelled` and TTFT sample for each 429 body). Each id's `submit`
        takes its room; `unreserve` gives back what none took."""
        with self._lock:
            if self.is_closed or self.error is not None:
                raise Closed(self.error or f"{self.owner} is shutting down")
            taken = self._num_in_flight + len(self._reserved)
            if self.max_in_flight is not None and taken + len(request_ids) > self.max_in_flight:
                raise Overloaded(f"{taken} requests in flight, and these {len(request_ids)} would pass the most this "
                                 f"{self.owner.removeprefix('the ')} queues ({self.max_in_flight}); retry later")
            self._reserved.update(request_ids)

    def unreserve(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            self._reserved.difference_update(request_ids)

    def submit(self, request: Request, deliver: Callable[[Delta], None]) -> None:
        """Queue a request; its deltas go to `deliver` (driver thread)."""
        with self._lock:
            if self.is_closed or self.error is not None:
                raise Closed(self.error or f"{self.owner} is shutting down")
            # the room bodies reserved counts as in flight, in the message too (a 429 said "374 requests
            # in flight, the most this server queues (512)": 138 were reserved)
            taken = self._num_in_flight + len(self._reserved)
            if request.id in self._reserved:
                self._reserved.discard(request.id)
            elif self.max_in_flight is not None and taken >= self.max_in_flight:
                raise Overloaded(f"{taken} requests in flight, the most this {self.owner.removeprefix('the ')} queues "
                                 f"({self.max_in_flight}); "
                                 "retry later")
            self._num_in_flight += 1
            self._num_put += 1
            self._inbox.append(("submit", (request, deliver, time.monotonic())))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        self._inbox.append(("cancel", request_id))
        self._wake.set()

    def cancel_refused(self, request_id: str) -> None:
        """Cancel a request whose body was refused for another of its prompts (the engine refused
        that one at admission): counted `refused` as the body's answer is, not `cancelled` (each
        such body counted a cancelled request a sibling)."""
        self._inbox.append(("cancel_refused", request_id))
        self._wake.set()

    def cancel_all(self) -> None:
        """Cancel every request in flight (a drain running out of time): each ends `cancelled`, so a
        stream ends with its error event and [DONE] instead of being cut by the server's exit."""
        self._inbox.append(("cancel_all", None))
        self._wake.set()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: submitted ones in the inbox (not its cancels) or in the
        conductor's queue. `taken` is read first: it never passes `put`, which only grows."""
        taken = self._num_taken
        return self._num_put - taken + self.driver.conductor.num_waiting

    @property
    def num_running(self) -> int:
        return self.driver.conductor.num_active

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Take no new requests, let those in flight finish (at most `timeout_s`), then stop the
        driver; requests still unfinished then end with an error."""
        with self._lock:
            self.is_closed = True
        self._wake.set()
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout_s)
        if thread.is_alive():
            self.driver.stop()
            self._wake.set()
            thread.join(None if timeout_s is None else STOP_GRACE_S)
        if thread.is_alive():  # inside a step that does not return: answer every client, leave the driver be
            self._answer_all(f"error: {self.owner} stopped while a step was still running")
            return
        self._fail_all(f"error: {self.owner} stopped before the request finished")

    def _answer_all(self, reason: str) -> None:
        """End every tracked request and those still in the inbox with `reason`, without touching
        the conductor, whose thread is still inside a step (a daemon thread: it does not hold the
        process). Its later deltas find no tracked request and go nowhere."""
        for request_id, item in list(self._tracked.items()):
            if self._tracked.pop(request_id, None) is not None:
                self._answer_unrun(item.request, item.deliver, reason)
        while True:
            try:  # (two closes at once, mstar serve's and its shutdown's, empty the inbox together)
                kind, payload = self._inbox.popleft()
            except IndexError:
                break
            if kind == "submit":
                self._num_taken += 1
                request, deliver, _ = payload
                self._answer_unrun(request, deliver, reason)

    # ------------------------------------------------------------ the driver's source

    def admit(self, conductor: Conductor, now: float) -> None:
        inbox = self._inbox
        while inbox:
            kind, payload = inbox.popleft()
            if kind == "submit":
                self._num_taken += 1
                self._admit_one(conductor, *payload)
            else:
                for request_id in (list(self._tracked) if kind == "cancel_all" else [payload]):
                    item = self._tracked.get(request_id)
                    if kind == "cancel_refused" and item is not None:
                        item.is_body_refused = True
                    conductor.cancel(request_id)
                    record = conductor.records.get(request_id)
                    if record is not None and record.is_finished:
                        self._finish(request_id)  # (cancelled while waiting, no on_finish would come for it)
        self._check_unstarted()

    def _admit_one(self, conductor: Conductor, request: Request, deliver: Callable[[Delta], None],
                   submit_s: float) -> None:
        """Track and submit one request; one the loop cannot take (its id already in flight, stop
        strings of the wrong kind) is refused alone, and the loop goes on (such a request killed
        the run loop, and every later call found it closed). submit_s: when `submit` queued it; a
        request queued while a step ran arrived then, so its TTFT counts the wait (on a simulated
        clock, whose time the inbox's wall time is not, it arrives now)."""
        try:
            if request.id in self._tracked or request.id in conductor.records:
                raise ValueError(f"request id {request.id!r} is already in flight")
            if any(scheduler.holds_tombstone(request.id) for scheduler in self.driver.schedulers.values()):
                # (its rows would be dropped as the ended request's until two steps pass: it stalled)
                raise ValueError(f"request id {request.id!r} belongs to a request that has just ended; give each "
                                 "request an id of its own (llm.request(...) makes one)")
            text = (TextStream(self.decode, request.stop_strings, request.min_tokens,
                               prompt_context(request.prompt_tokens, self.decode)) if self.decode is not None else None)
        except Exception as error:
            self._answer_unrun(request, deliver, f"error: {error}", is_refused=True)
            return
        self._tracked[request.id] = _Tracked(request, deliver, text, submit_s)
        self._unstarted.append(request.id)
        clock = self.driver.clock
        conductor.submit(request, None if clock.can_jump_ahead else clock() - (time.monotonic() - submit_s))

    def wake_times(self) -> list[float]:
        return []

    def is_done(self) -> bool:
        return self.is_closed and not self._inbox

    def is_waiting(self) -> bool:
        return False

    def idle(self, timeout: Optional[float]) -> None:
        self._wake.wait(timeout)
        self._wake.clear()

    # ------------------------------------------------------------ driver thread

    def _run(self) -> None:
        try:
            self.driver.run_source(self)
        except BaseException as error:  # a bug: every waiting client gets an answer, none hangs
            self.error = f"error: the run loop failed ({type(error).__name__}: {error})"
            self._fail_all(self.error)
            return
        if self.driver.is_stopped:
            # `close` stopped the driver; where a step outlasted its grace, close answered the
            # clients and left the conductor to this thread, which owns the engine: the requests
            # cut off are ended here once the step has returned (their KV pages stayed held in an
            # engine the caller may use again). After a step that returned in time, close's own
            # `_fail_all` finds nothing left.
            self._end_in_conductor(f"error: {self.owner} stopped before the request finished")

    def _on_step(self, launch: Launch) -> None:
        step = launch.step
        if step is None:
            return
        self.observer.on_step(step.key, self._mixtures.get((step.key, step.mask), step.key))
        tracked = self._tracked
        records = self.driver.conductor.records
        now = time.monotonic()  # one time stamp for the step's outputs
        for row in launch.ran_rows:
            item = tracked.get(row.request_id)
            if item is not None:
                self._push(item, records[row.request_id], False, now)

    def _on_finish(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._finish(request_id)
        self._check_unstarted()

    def _check_unstarted(self) -> None:
        """A request refused at admission never reaches `on_finish`: look at the requests admitted
        since the last look (a prefix of the unstarted queue: the conductor admits FIFO) and
        finish the refused ones. Stops at the first one still waiting."""
        unstarted = self._unstarted
        conductor = self.driver.conductor
        while unstarted:
            request_id = unstarted[0]
            if request_id in self._tracked:
                record = conductor.records.get(request_id)
                if record is not None and not record.is_finished and request_id not in conductor.active:
                    return  # still in the conductor's queue, and so is everything after it
                if record is not None and record.is_finished:
                    self._finish(request_id)
            unstarted.popleft()

    def _finish(self, request_id: str) -> None:
        item = self._tracked.pop(request_id, None)
        record = self.driver.conductor.records.pop(request_id, None)
        if item is None or record is None:
            return
        with self._lock:
            self._num_in_flight -= 1
        self.observer.on_finish(record.finish_reason or "error", record.is_refused or item.is_body_refused,
                                record.is_input_fault)
        if record.num_prefix_lookups:
            self.observer.on_prefix_lookups(record.num_prefix_lookups, record.num_cached_tokens)
        self._push(item, record, True, time.monotonic())

    def _push(self, item: _Tracked, record: RequestRecord, is_final: bool, now: float) -> None:
        """Deliver the emissions since the item's cursor (and the end, when final)."""
        values = record.emission_values
        start, end = item.cursor, len(values)
        if start == end and not is_final:
            return
        item.cursor = end
        token_ids: list[int] = []
        media: list[tuple[str, Any]] = []
        kinds = record.emission_kinds
        is_token = record.emission_is_token
        for index in range(start, end):
            modality = kinds[index][1]
            if modality == "text":
                value = values[index]
                if is_token[index]:
                    token_ids.append(value)
                else:
                    token_ids.extend(value if type(value) is list else token_ids_of(value))
            else:
                media.append((modality or "", record.emission_value(index)))
        logprobs = None
        if record.request.logprobs is not None:
            logprobs = [found for _, found in record.text_token_logprobs(start, end)]
        text = ""
        if item.text is not None:
            text = item.text.add(token_ids) if token_ids else ""
            if is_final:
                text += item.text.finish()
        delta = Delta(record.request.id, token_ids, text, media, None, False, len(record.request.prompt_tokens),
                      record.num_output_tokens, record.num_cached_tokens, logprobs=logprobs)
        if start == 0 and record.request.prompt_logprobs is not None:  # the prompt's, complete by the first token
            delta.prompt_logprobs = record.prompt_token_logprobs()
        if is_final:
            delta.finish_reason = record.finish_reason or "error"
            delta.is_refused = record.is_refused
            delta.is_input_fault = record.is_input_fault
        if token_ids or media:
            self._observe(item, now)
        item.deliver(delta)

    def _observe(self, item: _Tracked, now: float) -> None:
        if item.last_output_s is None:
            self.observer.on_first_output(now - item.submit_s)
        else:
            self.observer.on_output_gap(now - item.last_output_s)
        item.last_output_s = now

    def _fail_all(self, reason: str) -> None:
        """End every tracked request with `reason` (the driver is gone), and those still in the inbox."""
        self._end_in_conductor(reason)
        self._answer_all(reason)

    def _answer_unrun(self, request: Request, deliver: Callable[[Delta], None], reason: str,
                      is_refused: bool = False) -> None:
        """End a request the conductor will not finish (refused by the loop, or the loop is gone):
        one fewer in flight, counted by the observer as every answer is, and its final delta."""
        with self._lock:
            self._num_in_flight -= 1
        self.observer.on_finish(reason, is_refused)
        ids = request.prompt_tokens
        deliver(Delta(request.id, finish_reason=reason, is_refused=is_refused,
                      num_prompt_tokens=len(ids) if isinstance(ids, (list, tuple)) else 0))

    def _end_in_conductor(self, reason: str) -> None:
        """Fail the conductor's requests, waiting ones first (an ended one admits the next), so the
        engine frees their KV pages and slots: a `close(timeout)` that cut requests off left their
        pages held in an engine the caller may use again."""
        conductor = self.driver.conductor
        for request_id in [record.request.id for record in conductor.waiting] + list(conductor.active):
            try:
                conductor.fail(request_id, reason)
            except Exception:  # the run loop died mid-step: its state may not take it; answer the clients anyway
                pass


class _NoLog:
    """The driver's step log for a server: counts go to the observer, no list grows."""

    def add(self, launch: Any, post_s: float, end_s: float, gc_s: float = 0.0) -> None:
        pass

