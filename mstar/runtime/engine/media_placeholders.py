"""A prompt's media placeholders checked against the states its media make, when the request arrives.

In: per decoder with a `media_token` (Qwen3-ASR's), the encoder runners whose states replace its
placeholders; per request, its prompt tokens and media. Out: None, or why the request can never run
(the clip too long for its encoder, or the prompt holding another count of placeholders than the
clip makes states).

Why at admission: the decoder splices the states in at the prompt's first step (runners/decoder.py
`_splice`) and fails the request there when the counts differ. The front doors lay a prompt out
for its clip (serve/audio_prompt.py: `mstar run`'s prompts file, the server, `LLM.request`), but a
`Request` built by hand (or given to a Driver) was admitted, took its pages and failed mid-run.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence


class StateCounter(Protocol):
    node: Any  # the encoder's plan node: its name goes in a refusal

    def states_of(self, media: Mapping[str, Any]) -> Optional[int]: ...

    def media_problem(self, media: Mapping[str, Any]) -> Optional[str]: ...


class MediaPlaceholders:
    def __init__(self) -> None:
        self.feeds: list[tuple[str, int, list[StateCounter]]] = []  # (decoder, its media_token, encoders)

    def add(self, decoder: str, media_token: int, encoders: Sequence[StateCounter]) -> None:
        if encoders:
            self.feeds.append((decoder, media_token, list(encoders)))

    def problem(self, prompt_tokens: list[int], media: Mapping[str, Any]) -> Optional[str]:
        if not media:
            return None  # an encoder without its media fails the request itself, saying so
        for decoder, token, encoders in self.feeds:
            for encoder in encoders:
                problem = encoder.media_problem(media)
                if problem is not None:
                    return f"node {encoder.node.name}: {problem}"
            counts = [encoder.states_of(media) for encoder in encoders]
            if None in counts:
                continue  # media these encoders cannot count: they say why when they run
            num_states, num_held = sum(c for c in counts if c is not None), prompt_tokens.count(token)
            if num_held != num_states:
                return (f"node {decoder}: the prompt holds its media placeholder (token {token}) {num_held} times, "
                        f"and the media make {num_states} states: give the placeholder once per state (LLM.request, "
                        "the server and a prompts file lay a prompt out so)")
        return None
