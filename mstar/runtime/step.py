"""Plain data between the scheduler and an engine: a step in, per-row results out.

The scheduler and batch builder build `Step`s and touch no tensors; an engine (simulated or
torch) runs a step and answers with a `StepResult`. Keeping this interface narrow lets the
simulated engine and the real one plug into the same conductor and scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


@dataclass
class StepRow:
    """One request's share of a step."""

    request_id: str
    walk: str
    num_tokens: int  # tokens this row feeds this step (a prompt chunk, 1 for decode)
    context_len: int  # tokens already in this row's KV sequence before the step
    inputs: dict[str, Any] = field(default_factory=dict)  # input name -> value (token ids, tensors)
    loop_iter: int = 0  # iteration of the enclosing loop, 0 outside loops


@dataclass
class Step:
    worker: int
    key: str  # KeyPlan.name
    node: str
    mask: int  # which of the key's walks are present (MixtureEntry.mask)
    label: Optional[str]  # the single walk of a one-walk step: it may replay that walk's capture
    rows: list[StepRow]
    attention: str  # MixtureEntry.attention
    capture: Optional[str] = None  # CaptureFamily.name when the step pads to a captured bucket
    padded_batch: int = 0  # 0 = eager
    token_bucket: int = 0  # packed captures only
    is_speculative: bool = False


@dataclass
class RowResult:
    request_id: str
    outputs: dict[str, Any] = field(default_factory=dict)  # output edge name -> value
    is_stop: bool = False  # the node's stop check fired for this row (e.g. a stop token)
    error: Optional[str] = None  # this row failed alone; the request ends with this reason


@dataclass
class StepResult:
    rows: list[RowResult]
    # Rows that could not get KV pages or state slots: nothing ran for them, they are held and
    # retried (the scheduler's out-of-memory hold). Never lost.
    allocation_failed: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


class Engine(Protocol):
    """What the runtime needs from an engine."""

    def add_request(self, request_id: str, spec: Any) -> Optional[str]:
        """Prepare per-request state; returns an error message if the request can never fit."""

    def run_step(self, step: Step) -> StepResult: ...

    def end_request(self, request_id: str) -> None:
        """Free the request's KV pages and state slots."""
