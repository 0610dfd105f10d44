"""One partition of one request: its stages, current walk run, persisted values, token count.

The conductor owns one `PartitionState` per (request, partition). It is the walk run's input
source (stream chunks, persisted values, the request's prompt and media) and output sink
(persist, client, stream). Hand-off rule between walks, by the input's source in the walk
tables: "stream" takes a chunk of the partition's buffer of that name; the others take a
persisted value of the same name (the partition's own first), else for "prompt" the prompt the
first time the partition takes one and afterwards its latest persisted value (Orpheus:
prefill's new_token feeds decode), else for an image or audio prompt input the request's media
of that modality (None when absent, and for any other input: the engine synthesises stand-ins).
Persisted values a walk used are unpersisted when it ends. A partition with a repeat rule (the
plan's `repeat`) runs its stages again from the first after the last, taking the prompt again, while
its persisted value of that name is above zero, at most its max rounds (Whisper's windows).

A stream-consumer partition (no initial walk) starts a walk only when one of its streams has a
chunk. With one stage it re-runs that walk per chunk until its streams are exhausted (SNAC,
Code2Wav); with several stages it runs each once, in order (Qwen3-Omni's Talker).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from mstar.plan.schema import EdgePlan, PartitionPlan
from mstar.runtime.conductor.request import RequestRecord
from mstar.runtime.conductor.streams import StreamBuffer
from mstar.runtime.conductor.tables import MEDIA_OF, PROMPT, STREAM, RunWalk
from mstar.runtime.conductor.walk_run import WalkRun

LOG = logging.getLogger(__name__)


class PartitionState:
    def __init__(
        self,
        plan: PartitionPlan,
        walks: list[RunWalk],
        record: RequestRecord,
        buffers: dict[tuple[str, str], StreamBuffer],
        clock: Callable[[], float],
    ):
        self.plan = plan
        self.name = plan.name
        self.walks = walks  # the request's route through the stages
        self.record = record
        self.buffers = buffers  # shared by the request's partitions: (consumer partition, edge)
        self.own_buffers = [buf for (part, _), buf in buffers.items() if part == plan.name]
        self.clock = clock
        self.is_self_triggered = plan.initial_walk is None
        self.is_repeating = self.is_self_triggered and len(walks) == 1
        self.stage = 0
        self.run: Optional[WalkRun] = None
        self.store: dict[str, Any] = {}  # persisted values by edge name, latest last
        self.used_persisted: set[str] = set()
        self.is_prompt_used = False
        self.num_rounds = 1  # rounds through the stages begun (the plan's repeat rule counts them)
        self.num_tokens = 0
        self.max_tokens = record.request.max_tokens
        self.is_done = not walks
        self.is_length = False  # ended by max_tokens, or a walk's stop-conditioned loop by its limit
        self.ends_after_run = False  # a stop outside loops ended the route (stop_before_later_loops)
        self.other_stores: list[dict[str, Any]] = []  # the request's other partitions' stores
        self.owner: Any = None  # the conductor's state of the request (set by the conductor)

    # ------------------------------------------------------------ walks

    def start_next(self) -> Optional[WalkRun]:
        """Start the walk of the current stage; None when the partition has nothing to start."""
        if self.is_done or self.run is not None:
            return None
        if self.is_self_triggered:
            for buf in self.own_buffers:
                if buf.has_chunk():
                    break
            else:
                return None
        walk = self.walks[0] if self.is_repeating else self.walks[self.stage]
        self.run = WalkRun(walk, self, self, self.record.request.loop_counts)
        self.run.context = self.owner.context if self.owner is not None else {}
        self.run.start()
        return self.run

    def finish_run(self) -> None:
        """The current walk run ended: unpersist what it used, move to the next stage."""
        for name in self.used_persisted:
            self.store.pop(name, None)
        self.used_persisted.clear()
        if self.run is not None:
            self.is_length = self.is_length or self.run.is_cut
            self.run.cancel()  # a call still active in a finished walk never runs (nor is ready)
        self.run = None
        self.stage += 1
        if self.ends_after_run:
            self.is_done = True
            return
        # A one-stage stream consumer re-runs its walk per chunk (SNAC, Code2Wav) until its
        # streams are exhausted; a partition with a repeat rule runs its stages again while the
        # rule holds (Whisper's windows); any other partition is done after its last stage (Talker).
        if self.stage >= len(self.walks) and not self.is_repeating:
            if self._repeats():
                self.stage = 0
                self.num_rounds += 1
                self.is_prompt_used = False  # each round starts as the first: from the prompt
            else:
                self.is_done = True

    def _repeats(self) -> bool:
        """The plan's repeat rule: its persisted value is a number above zero and the partition has
        run fewer than its max rounds. A value that is not a number (an engine's mistake) ends the
        partition, with a warning."""
        repeat = self.plan.repeat
        if repeat is None or self.num_rounds >= repeat.max_rounds:
            return False
        value = self.store.get(repeat.value)
        if value is None:
            return False
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            LOG.warning("partition %s repeats while '%s' is above zero, but its value is %s, not a number: "
                        "it ends", self.name, repeat.value, type(value).__name__)
            return False
        return value > 0

    def may_count_more(self, stop_loop: Optional[int] = None) -> bool:
        """Whether an output could still be counted after the one just counted: max_tokens ends the
        partition only then. stop_loop: the loop the model's stop (a stop token, not a limit) of the
        counted row ends, or None. A run counts no more after its one counting call ran outside
        loops, or after a model's stop ending the one loop around its one counting call; with
        later stages that count nothing the partition then cannot (BAGEL's image route:
        prefill_text's token, then image_gen's flow loop; a decode loop's stop token as its
        max_tokens-th, which ends `stop`). A partition that repeats its stages or re-runs its walk
        per chunk may."""
        if self.can_run_again():
            return True
        run = self.run
        if run is not None and not (run.walk.counts_once or stop_loop in run.walk.stop_ends_counts):
            return True
        later = self.walks[self.stage + 1:] if run is not None else self.walks[self.stage:]
        return any(walk.counts_output for walk in later)

    def stops_outside_loops(self) -> bool:
        """Whether a model's stop sampled by a counting call outside loops (a prefill's first token
        is a stop token) ends the partition: where an output could still be counted after it (the
        decode after llama's prefill; not BAGEL's image_gen after prefill_text, which then runs), in
        a partition that neither repeats (a Whisper window's stop is the repeat rule's to read) nor
        re-runs per chunk. No loop holds such a call for the stop to end, so the decode ran on."""
        if self.is_done or self.can_run_again():
            return False
        return self.may_count_more()

    def stop_before_later_loops(self, node: str, is_length: bool) -> None:
        """A call of `node` outside loops that counts nothing sampled a stop: a stop token, or the
        request's max_tokens-th sample (`is_length`). Where a later stage of the route loops until
        that node stops, the partition ends after the current walk, cut where the stop was a limit:
        that loop would sample past the stop (Qwen3-TTS's Talker: its prefill's frame, then a
        decode frame, two frames for max_tokens 1). Counted calls end by their counts
        (`stops_outside_loops`, `may_count_more`); a partition that runs again reads its own rule."""
        if self.is_done or self.can_run_again():
            return
        if any(node in walk.stopping_nodes for walk in self.walks[self.stage + 1:]):
            self.ends_after_run = True
            self.is_length = self.is_length or is_length

    def can_run_again(self) -> bool:
        """Whether the partition may start its walks again after the last: it repeats its stages
        (the plan's repeat rule: Whisper's windows) or re-runs its one walk per chunk (SNAC). Such
        a partition may count more after any output, and a model's stop outside loops is its
        rule's to read, not an end (`may_count_more`, `stops_outside_loops`)."""
        return self.plan.repeat is not None or self.is_repeating

    def end(self, is_length: bool = False) -> None:
        """End the partition now (max tokens, or its streams ran dry)."""
        if self.run is not None:
            self.run.cancel()
            self.run = None
        self.is_done = True
        self.is_length = self.is_length or is_length

    def is_starved(self) -> bool:
        """The run waits on a stream input that will never come again."""
        run = self.run
        if run is None or not run.waiting:
            return False
        for active in run.waiting:
            for name, _, _, source in active.call.inputs:
                if source == STREAM:
                    buf = self.buffers.get((self.name, name))
                    if buf is None or buf.is_exhausted:  # no buffer: no stream feeds it
                        return True
        return False

    def is_drained(self) -> bool:
        """Self-triggered partition with no run and no chunk that will ever come."""
        if not self.is_repeating or self.run is not None:
            return False
        for buf in self.own_buffers:
            if not buf.is_producer_done or not buf.is_exhausted:
                return False
        return True

    # ------------------------------------------------------------ InputSource

    def can_supply(self, name: str, source: int) -> bool:
        if source == STREAM:
            buf = self.buffers.get((self.name, name))
            return buf is not None and buf.has_chunk()
        return True

    def take(self, name: str, source: int) -> Any:
        if source == STREAM:
            chunk = self.buffers[(self.name, name)].poll()
            return chunk.items if chunk is not None else []
        if name in self.store:
            self.used_persisted.add(name)
            return self.store[name]
        if source == PROMPT:
            if not self.is_prompt_used:
                self.is_prompt_used = True
                return self.record.request.prompt_tokens
            if self.store:
                latest = next(reversed(self.store))
                self.used_persisted.add(latest)
                return self.store[latest]
        for store in self.other_stores:
            if name in store:
                return store[name]
        modality = MEDIA_OF.get(source)
        return self.record.request.media.get(modality) if modality is not None else None

    # ------------------------------------------------------------ OutputSink

    def deliver(self, edge: EdgePlan, value: Any) -> None:
        if edge.is_persist:
            self.store.pop(edge.name, None)  # re-insert: latest persisted value last
            self.store[edge.name] = value
        if edge.dest_kind == "client":
            self.record.emit(self.clock(), (edge.name, edge.modality), value)
        elif edge.dest_kind == "stream":
            buf = self.buffers.get((edge.stream_partition or "", edge.name))
            if buf is not None:
                buf.push(value)
