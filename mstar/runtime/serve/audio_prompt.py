"""A prompt laid out for audio states that replace placeholders (a decoder's `media_token`).

In: a plan, and per request its prompt tokens and the number of its audio samples. Out:
`audio_layout_of(plan)` -> the `AudioLayout` (the placeholder id of the text prompt node's
`media_token`, the states rule of the audio prompt's encoder), or None when no text prompt node
has a `media_token` (Whisper, the stand-in encoders: prompts go in unchanged); `expand(layout,
tokens, num_samples)` -> the prompt with its one placeholder repeated once per state the encoder
makes of that clip (as transformers' Qwen3ASRProcessor expands `<|audio_pad|>`), or the prompt
unchanged when it already holds that many; an `AudioPromptError` otherwise, saying what to give.

Which rule counts the states is the encoder's `style` (mstar/plan/node_args.py), never a name:
`qwen3_asr` -> models/qwen3_asr.py `num_states`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from mstar.plan.schema import Plan


class AudioPromptError(ValueError):
    """A request whose prompt cannot hold its audio's states; the message says why."""


@dataclass(frozen=True)
class AudioLayout:
    placeholder: int  # the token id the states replace
    num_states: Callable[[int], int]  # samples -> states


def audio_layout_of(plan: Plan) -> Optional[AudioLayout]:
    tokens = {node.dims["media_token"] for node in plan.nodes if node.engine == "kv" and "media_token" in node.dims
              and any(i.prompt == "text" for i in node.input_roles)}
    if not tokens:
        return None
    if len(tokens) > 1:
        raise AudioPromptError(f"the plan's text prompt nodes name different media tokens {sorted(tokens)}; a "
                               "prompt has one layout")
    styles = {node.dims.get("style") for node in plan.nodes if any(i.prompt == "audio" for i in node.input_roles)}
    if styles != {"qwen3_asr"}:
        raise AudioPromptError(f"the plan's media_token needs an audio encoder whose states can be counted "
                               f"from the clip (style qwen3_asr), found styles {sorted(map(str, styles))}")
    from mstar.runtime.engine.models.qwen3_asr import num_states  # brings torch: only for such plans

    placeholder = tokens.pop()
    assert isinstance(placeholder, int)  # the compiler checks media_token is a token id
    return AudioLayout(placeholder, num_states)


def expand(layout: AudioLayout, tokens: list[int], num_samples: int) -> list[int]:
    count = layout.num_states(num_samples)
    num_placeholders = tokens.count(layout.placeholder)
    if num_placeholders == count:
        return tokens
    if num_placeholders != 1:
        raise AudioPromptError(f"the prompt must hold the audio placeholder (token {layout.placeholder}) once, or "
                               f"once per audio state ({count}); it holds it {num_placeholders} times (give "
                               f"'prompt_tokens' laid out so, or a tokenizer for the spec's prompt_format)")
    at = tokens.index(layout.placeholder)
    return tokens[:at] + [layout.placeholder] * count + tokens[at + 1:]
