"""Whisper's long-form windows, as transformers' `WhisperForConditionalGeneration.generate` seeks
through audio longer than 30 s (more than 3000 log-mel frames) with greedy decoding.

In: the request's sample count and the audio not yet transcribed (`audio_left`, samples; absent
before the first window). Out: the window the encoder cuts from the whole clip's log-mel features
(`AudioWindow`, carried to the decoder as a `signal` value), and, from a window's generated tokens,
the tokens final so far and the audio left after it (`segment_cut`, `AudioWindow.left_after`).

- Frames: the whole clip's features have `num_samples // 160` frames (WhisperFeatureExtractor with
  truncation off). A window starts at frame `seek`, holds `min(total - seek, 3000)` of them, and is
  zero-padded to 3000 (transformers pads the features with 0, not with silence).
- Segments (`_retrieve_segment`): in the window's generated tokens (end of text dropped), each pair
  of consecutive timestamps closes a segment. With at least one pair, the transcript keeps the
  tokens up to the last pair's second timestamp and the next window starts at the last pair's first
  timestamp (a timestamp step is 2 frames), unless the tokens end in a single timestamp (no speech
  after it): then all tokens are kept and the next window starts after this one. Without a pair every
  token is kept and the next window starts after this one.
- Tokens final before the window ends (`closed_cut`): those up to the last pair's second timestamp;
  whatever comes later, the window keeps them. The rest is decided when the window ends (a single
  timestamp at the end keeps them, a token after it does not), so a transcript is released segment
  by segment and the window's last step completes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mstar.runtime.engine.models.log_mel import HOP_LENGTH, NUM_FRAMES

FRAMES_PER_TIMESTAMP = 2  # a timestamp step is 0.02 s: the encoder's input stride (two convolutions' 1 x 2)
SIGNAL_LENGTH = 4  # AudioWindow.to_signal


class WindowError(ValueError):
    """A window signal or an audio_left value the runners cannot use."""


@dataclass(frozen=True)
class AudioWindow:
    start_frame: int
    num_frames: int  # frames of audio in this window (at most NUM_FRAMES); the rest is padding
    total_frames: int
    num_samples: int

    @property
    def is_long_form(self) -> bool:
        """Audio past one window: transformers turns timestamps on and seeks window by window."""
        return self.total_frames > NUM_FRAMES

    def to_signal(self) -> list[int]:
        return [self.start_frame, self.num_frames, self.total_frames, self.num_samples]

    @classmethod
    def of_signal(cls, value: Any) -> "AudioWindow":
        if (not isinstance(value, (list, tuple)) or len(value) != SIGNAL_LENGTH
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
            raise WindowError(f"an audio window is {SIGNAL_LENGTH} counts (start frame, frames, total frames, "
                              f"samples), got {value!r}")
        return cls(*value)

    def left_after(self, offset_frames: int) -> int:
        """Samples not yet transcribed once the next window starts `offset_frames` after this one's
        start: 0 when it would start at or past the last frame (transformers' `seek < max_frames`)."""
        seek = self.start_frame + offset_frames
        return 0 if seek >= self.total_frames else self.num_samples - seek * HOP_LENGTH


def window_of(num_samples: int, audio_left: Optional[Any]) -> AudioWindow:
    """The window starting where `audio_left` samples remain (None: the first window)."""
    total = num_samples // HOP_LENGTH
    if audio_left is None:
        start = 0
    else:
        if isinstance(audio_left, bool) or not isinstance(audio_left, int) or not 0 < audio_left <= num_samples:
            raise WindowError(f"audio_left must be a count of samples in 1..{num_samples}, got {audio_left!r}")
        start = (num_samples - audio_left) // HOP_LENGTH
    return AudioWindow(start, min(total - start, NUM_FRAMES), total, num_samples)


def _pair_ends(generated: list[int], timestamp_begin: int) -> list[int]:
    """Indices of the second timestamp of each pair of consecutive timestamps."""
    return [i + 1 for i in range(len(generated) - 1)
            if generated[i] >= timestamp_begin and generated[i + 1] >= timestamp_begin]


def segment_cut(generated: list[int], timestamp_begin: int, window: AudioWindow) -> tuple[int, int]:
    """(how many of the window's generated tokens the transcript keeps, frames from the window's
    start to the next window) when the window ends with `generated` (end of text excluded)."""
    pair_ends = _pair_ends(generated, timestamp_begin)
    is_single_ending = [t >= timestamp_begin for t in generated[-2:]] == [False, True]
    if not pair_ends or is_single_ending:
        return len(generated), window.num_frames
    last = pair_ends[-1]
    return last + 1, (generated[last - 1] - timestamp_begin) * FRAMES_PER_TIMESTAMP


def closed_cut(generated: list[int], timestamp_begin: int) -> int:
    """How many of the window's generated tokens the transcript keeps however the window goes on."""
    pair_ends = _pair_ends(generated, timestamp_begin)
    return pair_ends[-1] + 1 if pair_ends else 0
