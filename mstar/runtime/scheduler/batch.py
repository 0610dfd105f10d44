"""A batch: the scheduler's decision for one step, as plain data.

The scheduler returns a `Batch`; the conductor turns it into a `mstar.runtime.step.Step` by
attaching each row's inputs. A batch touches no tensors. Per-row fields (`request_ids`, `walks`,
`num_tokens`) are parallel lists in the order the rows joined the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(slots=True)
class Batch:
    """One step chosen by a `WorkerScheduler`.

    key, node:      the scheduling key (KeyPlan.name) and its node.
    mask:           bit i set = KeyPlan.walks[i] has a row in the step (MixtureEntry.mask).
    label:          the single walk of a one-walk step (it may replay that walk's own capture);
                    None for a mixed step.
    request_ids, walks, num_tokens: per row, parallel lists (rows of one walk are contiguous in
                    FIFO order for steps built by `next_batch`).
    capture:        CaptureFamily.name the step pads into, None when it runs eagerly.
    padded_batch:   the captured batch size the step pads to (0 = eager).
    token_bucket:   the packed capture's token bucket (0 for batched captures and eager steps).
    attention:      MixtureEntry.attention of the step's mixture.
    is_speculative: built by `WorkerScheduler.speculate` while the previous step runs.
    is_guided:      some row's request requires guidance on the node (the step's guidance mode;
                    its capture is one of that mode or of both). False on a key whose captures
                    do not depend on the mode.
    is_follower:    a TP follower running its leader's batch (composition copied from the leader).
    """

    worker: int
    key: str
    node: str
    mask: int
    label: Optional[str]
    request_ids: list[str]
    walks: list[str]
    num_tokens: list[int]
    capture: Optional[str]
    padded_batch: int
    token_bucket: int
    attention: str
    is_speculative: bool = False
    is_follower: bool = False
    is_guided: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)
