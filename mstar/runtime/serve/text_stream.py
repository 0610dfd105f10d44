"""A request's output text, delta by delta, as its tokens arrive.

In: `decode(ids) -> str` (the tokenizer's, special tokens skipped), the request's stop strings
and its prompt's last tokens (`context`); then token ids in the order they were generated
(`add`), and the end (`finish`). Out: text deltas whose concatenation is the final text, cut
before the first stop string.

The output is decoded after the prompt's last tokens (mstar/runtime/conductor/text_context.py
says why).

Decoding is incremental (the offsets method of text-generation-inference): only the tokens since
the last emitted boundary are decoded, together with a few before them so that a tokenizer that
merges spaces or multi-byte characters across tokens decodes them in context; text that ends in
an incomplete character (U+FFFD) waits for the next token. So each token costs the same however
long the output is. With stop strings the last `longest stop - 1` characters wait until the
text after them shows they do not start a stop string (a stop string is never streamed), and each
step looks for them only where one could start in the new text. With `min_tokens` (vLLM's) a stop
string counts only where it ends past the text of the first min_tokens tokens.
"""
from __future__ import annotations

from typing import Callable, Sequence

from mstar.runtime.conductor.text_context import text_after
from mstar.runtime.serve.tokenizer import stop_text_index

INCOMPLETE = "\ufffd"  # what a decoder gives for a byte sequence cut inside a character


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), min_tokens: int = 0,
                 context: Sequence[int] = ()):
        self._decode = decode
        self._stops = list(stops)
        self._min_tokens = min_tokens
        # characters a stop string must end past: the first min_tokens tokens' text (known once
        # they have come; until then no stop string counts)
        self._after = 0 if not (min_tokens and self._stops) else None
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = list(context)  # the prompt's last tokens, then the output's
        self._start = len(self._ids)  # the output's first token
        self._prefix = 0  # tokens before it are final text; decoding starts here for context
        self._read = self._start  # tokens before it are in `text`
        self.text = ""  # decoded so far (maybe past a stop string)
        self._num_shown = 0  # characters of `text` already handed out
        self._num_searched = 0  # no stop string starts before it (each step searches the new text only)
        self.is_stopped = False  # a stop string appeared: nothing more is shown

    def add(self, ids: Sequence[int]) -> str:
        """The new text that can be shown after these tokens ('' when it must wait)."""
        self._ids.extend(ids)
        if self._after is None and len(self._ids) - self._start >= self._min_tokens:
            first = self._ids[self._start:self._start + self._min_tokens]
            self._after = len(text_after(self._decode, self._ids[:self._start], first))
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(INCOMPLETE):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._show(is_final=False)

    def finish(self) -> str:
        """The rest of the text (everything left, up to the first stop string)."""
        rest = self._decode(self._ids[self._prefix:])
        already = self._decode(self._ids[self._prefix:self._read])
        if len(rest) > len(already):
            self.text += rest[len(already):]
        self._prefix = self._read = len(self._ids)
        return self._show(is_final=True)

    @property
    def shown(self) -> str:
        return self.text[:self._num_shown]

    def _show(self, is_final: bool) -> str:
        if self.is_stopped:
            return ""
        end = len(self.text)
        cut = None
        if self._stops and self._after is not None:
            cut = stop_text_index(self.text, self._stops, self._num_searched, self._after)
            # a stop string starting in the last `hold` characters may end in text still to come
            self._num_searched = max(self._num_searched, end - self._hold)
        if cut is not None:
            end = cut
            self.is_stopped = True
        elif not is_final:
            end = max(self._num_shown, end - self._hold)
        delta = self.text[self._num_shown:end]
        self._num_shown = end
        return delta
