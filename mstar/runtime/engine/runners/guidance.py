"""Classifier-free guidance for image-flow steps (BAGEL), from the plan's roles: which KV sequences a
row writes and reads, and how the velocities of the sequences combine.

In: a kv `NodePlan` (`kv_sequences`, `kv_access` per walk, `guidance` labels with the prompt part
each drops and its default scale) and a request's `GuidanceParams` (scales it sets, by label).
Out: `NodeGuidance`, which answers per walk which sequences a row writes or reads, and combines.

The first KV sequence holds the whole prompt; each guidance sequence is kept without part of it
(BAGEL, reference section 1.2: `cfg_text` drops the text and sees the images only, `cfg_img` drops
the images and sees the text only), so each walk writes the sequences its spec line names (a text
row `main cfg_img`, an image row `main cfg_text`), less any whose guidance drops what the row feeds
(Cosmos3's `uncond` drops text: its text prefill, `writes main uncond`, writes `main` alone, and the
unconditioned branch attends over no text, as `_needed_pages` budgets it). An image-flow row reads
its walk's `reads` and combines the velocities in guidance order, as BAGEL does:

    v = v_first
    v = v_g + scale_g * (v - v_g)         for each guidance label g (a later one only when scale_g > 1)
    v = v * clamp(|v_first| / |v|, max=1)  (global renorm)

inside the guidance interval (noise level 1 - step/steps in (0.4, 1.0], the reference default);
outside it, v = v_first. A request is guided on a node when its route takes a walk that reads a
guidance sequence there and a scale is above 1 (the spec's defaults: BAGEL's 4.0 for text and 1.0
for images): the plan's rule, mstar/plan/guidance_mode.py, which the scheduler's capture pick
keys on too. Unguided requests use the first sequence only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.plan.schema import NodePlan

INTERVAL = (0.4, 1.0)


class GuidanceError(ValueError):
    """A request's guidance scales are out of range."""


@dataclass(frozen=True)
class GuidanceParams:
    """Scales a request sets, by guidance label; a label it leaves out keeps the spec's default."""

    scales: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_request(cls, request: Any) -> "GuidanceParams":
        get = request.get if isinstance(request, dict) else (lambda name: getattr(request, name, None))
        given = get("guidance") or {}
        if not isinstance(given, dict):
            raise GuidanceError(f"guidance must map guidance labels to scales, got {given!r}")
        scales = {}
        for label, value in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise GuidanceError(f"guidance scale of {label} must be a number >= 0, got {value!r}")
            scales[str(label)] = float(value)
        return cls(scales)


@dataclass(frozen=True)
class NodeGuidance:
    """The guidance roles of one kv node (module docstring)."""

    first: str
    labels: tuple[str, ...]
    defaults: tuple[float, ...]
    writes: dict[str, tuple[str, ...]]
    reads: dict[str, tuple[str, ...]]
    # walks whose rows attend over the sequences without extending any (their kv access writes
    # none of the node's sequences: an image flow, a read-only KV walk)
    read_only_walks: frozenset[str] = frozenset()
    drops: dict[str, str] = field(default_factory=dict)  # guidance label -> the prompt part it is kept without

    @classmethod
    def of(cls, node: NodePlan) -> "NodeGuidance":
        labels = tuple(g.label for g in node.guidance)
        return cls(
            first=node.kv_sequences[0],
            labels=labels,
            defaults=tuple(g.scale for g in node.guidance),
            writes={a.walk: tuple(a.writes) for a in node.kv_access},
            reads={a.walk: tuple(a.reads) for a in node.kv_access},
            read_only_walks=frozenset(a.walk for a in node.kv_access if set(a.writes).isdisjoint(node.kv_sequences)),
            drops={g.label: g.drops for g in node.guidance},
        )

    def scales(self, params: GuidanceParams) -> tuple[float, ...]:
        return tuple(params.scales.get(label, default) for label, default in zip(self.labels, self.defaults))

    def written(self, walk: str, is_guided: bool, fed: frozenset[str] = frozenset()) -> tuple[str, ...]:
        """The KV sequences a row of `walk` extends (none for a read-only walk): its walk's, less a
        guidance sequence kept without a part of the prompt the row feeds (`fed`: "text", "image").
        (Cosmos3's text prefill wrote its text into `uncond`, which drops text: the unconditioned
        branch held the prompt, and every guidance scale gave the same image.)"""
        if walk in self.read_only_walks:
            return ()
        if not is_guided:
            return (self.first,)
        return tuple(label for label in self.writes.get(walk) or (self.first,) if self.drops.get(label) not in fed)

    def read(self, walk: str, is_guided: bool) -> tuple[str, ...]:
        """The KV sequences a read-only row of `walk` attends over (the first one first)."""
        return (self.reads.get(walk) or (self.first,)) if is_guided else (self.first,)

    def combine(self, velocities: dict[str, torch.Tensor], params: GuidanceParams) -> torch.Tensor:
        """The guided velocity from each read sequence's (formula in the module docstring)."""
        v_first = velocities[self.first]
        v = v_first
        for index, (label, scale) in enumerate(zip(self.labels, self.scales(params))):
            if label in velocities and (index == 0 or scale > 1.0):
                v = velocities[label] + scale * (v - velocities[label])
        norm = (v_first.norm() / (v.norm() + 1e-8)).clamp(max=1.0)
        return v * norm


def in_interval(time_index: int, num_steps: int) -> bool:
    noise = 1.0 - time_index / max(num_steps, 1)
    return INTERVAL[0] < noise <= INTERVAL[1]
