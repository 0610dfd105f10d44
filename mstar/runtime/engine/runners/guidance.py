"""Classifier-free guidance for image-flow steps (BAGEL): which KV sequences a row writes and reads,
and how the velocities of the three sequences combine.

A kv node that declares `kv_sequences main cfg_text cfg_img` keeps, for a guided request, three
contexts of the same prompt (reference section 1.2):
- `main`: everything (images and text);
- `cfg_text`: without the text, so it sees only the images (the text-unconditioned branch);
- `cfg_img`: without the images, so it sees only the text (the image-unconditioned branch).
So a row that feeds token ids (prefill_text, decode) writes `main` and `cfg_img`; a row that feeds
embeddings (prefill_vit, prefill_vae) writes `main` and `cfg_text`. An image-flow step reads all
three and combines the velocities as BAGEL does:

    v = v_cfg_text + text_scale * (v_main - v_cfg_text)
    v = v_cfg_img + img_scale * (v - v_cfg_img)            (only when img_scale > 1)
    v = v * clamp(|v_main| / |v|, max=1)                   (global renorm)

inside the guidance interval (noise level 1 - step/steps in (0.4, 1.0], the reference default);
outside it, v = v_main. A request is guided on a node when its route takes a walk with an
image-flow call on that node and a scale is above 1 (defaults: text 4.0, image 1.0, the
reference's generation defaults). Unguided requests use `main` only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

MAIN, CFG_TEXT, CFG_IMG = "main", "cfg_text", "cfg_img"
CFG_LABELS = (CFG_TEXT, CFG_IMG)
DEFAULT_TEXT_SCALE = 4.0
DEFAULT_IMG_SCALE = 1.0
INTERVAL = (0.4, 1.0)


class GuidanceError(ValueError):
    """A request's guidance scales are out of range."""


@dataclass(frozen=True)
class GuidanceParams:
    text_scale: float = DEFAULT_TEXT_SCALE
    img_scale: float = DEFAULT_IMG_SCALE

    @property
    def is_on(self) -> bool:
        return self.text_scale > 1.0 or self.img_scale > 1.0

    @classmethod
    def from_request(cls, request: Any) -> "GuidanceParams":
        get = request.get if isinstance(request, dict) else (lambda name: getattr(request, name, None))
        values = {}
        for field_name, key in (("text_scale", "cfg_text_scale"), ("img_scale", "cfg_img_scale")):
            value = get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise GuidanceError(f"{key} must be a number >= 0, got {value!r}")
            values[field_name] = float(value)
        return cls(**values)


def has_guidance_sequences(labels: list[str]) -> bool:
    return MAIN in labels and all(label in labels for label in CFG_LABELS)


def sequences_written(is_text: bool, is_guided: bool) -> tuple[str, ...]:
    """The KV sequences a writing row extends: text rows skip cfg_text, embedding rows cfg_img."""
    if not is_guided:
        return (MAIN,)
    return (MAIN, CFG_IMG) if is_text else (MAIN, CFG_TEXT)


def sequences_read(is_guided: bool) -> tuple[str, ...]:
    """The KV sequences an image-flow row attends over, in the order `combine` takes them."""
    return (MAIN, CFG_TEXT, CFG_IMG) if is_guided else (MAIN,)


def in_interval(time_index: int, num_steps: int) -> bool:
    noise = 1.0 - time_index / max(num_steps, 1)
    return INTERVAL[0] < noise <= INTERVAL[1]


def combine(v_main: torch.Tensor, v_cfg_text: torch.Tensor, v_cfg_img: Optional[torch.Tensor],
            params: GuidanceParams) -> torch.Tensor:
    """The guided velocity (formula in the module docstring)."""
    v = v_cfg_text + params.text_scale * (v_main - v_cfg_text)
    if params.img_scale > 1.0 and v_cfg_img is not None:
        v = v_cfg_img + params.img_scale * (v - v_cfg_img)
    scale = (v_main.norm() / (v.norm() + 1e-8)).clamp(max=1.0)
    return v * scale
