"""Whisper's decoding rules, as transformers' `WhisperForConditionalGeneration.generate` applies them
to one window: the start sequence, language detection, suppressed tokens, timestamps (long form,
audio past 30 s, turns timestamps on and seeks between windows: runners/whisper_windows.py).

In: the checkpoint's generation_config.json (or, without one, the multilingual layout derived from
the vocabulary, below) and, per request, its decoder prompt. Out: per step either a forced token or
the logits to sample from.

- Start sequence: an empty prompt (or the start token alone) becomes `<|startoftranscript|>`, then
  the generation config's `forced_decoder_ids` in order (a null id is the language slot; published
  checkpoints force `[null, <|transcribe|>]`), the language slot alone when there are none and the
  config has `lang_to_id`, then `<|notimestamps|>`. The language slot is detected: the decoder's
  logits after the start token, every non-language token masked, argmax. Each of these is one
  decoder step here (transformers runs the detection as a separate forward, then prefills the
  start sequence at once: the same numbers, causal attention). A longer prompt is taken as the
  whole start sequence; timestamps are on when it lacks `<|notimestamps|>`.
- After the start sequence (its length is the `begin_index`): `suppress_tokens` are masked at every
  step, `begin_suppress_tokens` at the first one, and with timestamps the timestamp rule
  (WhisperTimeStampLogitsProcessor): no `<|notimestamps|>`; timestamps in pairs (after a pair a text
  token, after a single one a timestamp or the end); timestamps never decrease; the first token is
  a timestamp (at most `max_initial_timestamp_index` when set); when the timestamps' total
  probability beats every text token, a timestamp.
- Layout without a generation config (multilingual Whisper; large-v3's numbers in brackets):
  end of text = the node's stop token (50257), start = end + 1 (50258), languages from start + 1 up
  to translate - 1, `<|notimestamps|>` = vocab - 1502 (50364, the 1501 timestamps 0.00..30.00 end
  the vocabulary), transcribe = notimestamps - 4 (50360), translate = transcribe - 1 (50359); no
  suppressed tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

NUM_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>


@dataclass(frozen=True)
class WhisperRules:
    start: int
    eos: int
    language_ids: tuple[int, ...]
    transcribe: Optional[int]
    no_timestamps: Optional[int]
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    max_initial_timestamp_index: Optional[int] = None
    # the start sequence after the start token: "language" (detected) or forced token ids
    steps: tuple[Union[str, int], ...] = ()

    @classmethod
    def layout(cls, vocab: int, eos: int) -> "WhisperRules":
        """The multilingual layout (module docstring), for a decoder without a generation config."""
        no_timestamps = vocab - NUM_TIMESTAMPS - 1
        transcribe = no_timestamps - 4
        return cls(start=eos + 1, eos=eos, language_ids=tuple(range(eos + 2, transcribe - 1)),
                   transcribe=transcribe, no_timestamps=no_timestamps, steps=("language", transcribe, no_timestamps))

    @classmethod
    def of_config(cls, config: dict, eos: int) -> "WhisperRules":
        """From generation_config.json's fields (already checked to be ints / lists of ints)."""
        tasks = config.get("task_to_id") or {}
        languages = config.get("lang_to_id") or {}
        end = config.get("eos_token_id", eos)
        steps: list[Union[str, int]] = [token if token is not None else "language"
                                        for _, token in sorted(config.get("forced_decoder_ids") or [])]
        if languages and not steps:
            steps = ["language"]  # transformers detects the language when position 1 is not forced
        no_timestamps = config.get("no_timestamps_token_id")
        if no_timestamps is not None and steps[-1:] != [no_timestamps]:
            steps.append(no_timestamps)
        return cls(start=config["decoder_start_token_id"], eos=end if isinstance(end, int) else end[0],
                   language_ids=tuple(sorted(languages.values())), transcribe=tasks.get("transcribe"),
                   no_timestamps=no_timestamps, suppress=tuple(config.get("suppress_tokens") or ()),
                   begin_suppress=tuple(config.get("begin_suppress_tokens") or ()),
                   max_initial_timestamp_index=config.get("max_initial_timestamp_index"), steps=tuple(steps))


@dataclass
class WhisperSequence:
    """One request's decoder tokens and where its free generation begins."""

    tokens: list[int]
    pending: list[Union[str, int]] = field(default_factory=list)  # "language" or forced token ids
    begin_index: int = 0
    is_timestamps: bool = False

    @classmethod
    def start(cls, prompt: list[int], rules: WhisperRules, is_timestamps: bool = False) -> "WhisperSequence":
        """`is_timestamps`: timestamps on whatever the prompt says (long form: a trailing
        `<|notimestamps|>` is dropped from the prompt or the forced steps, as generate does)."""
        stamp_off = rules.no_timestamps
        if prompt and prompt != [rules.start]:
            tokens = list(prompt[:-1] if is_timestamps and prompt[-1:] == [stamp_off] else prompt)
            return cls(tokens, [], len(tokens), is_timestamps or (stamp_off is not None and stamp_off not in tokens))
        pending = [step for step in rules.steps if step != "language" or rules.language_ids]
        if is_timestamps and pending[-1:] == [stamp_off]:
            pending.pop()
        return cls([rules.start], pending, 1 + len(pending), is_timestamps)

    def restarted(self) -> "WhisperSequence":
        """The next window's sequence: this one's start sequence (forced tokens and the detected
        language as they came), nothing generated yet."""
        return WhisperSequence(self.tokens[:self.begin_index], [], self.begin_index, self.is_timestamps)


def next_token(logits: torch.Tensor, sequence: WhisperSequence, rules: WhisperRules) -> Optional[int]:
    """The token the rules force for the next position (a detected language counts), else None:
    then sample from `processed(logits, ...)`. Pops the pending step it answers."""
    if not sequence.pending:
        return None
    step = sequence.pending.pop(0)
    if step != "language":
        return int(step)
    masked = torch.full_like(logits, float("-inf"))
    ids = list(rules.language_ids)
    masked[ids] = logits[ids]
    return int(masked.argmax())


def processed(logits: torch.Tensor, sequence: WhisperSequence, rules: WhisperRules) -> torch.Tensor:
    """The logits `[vocab]` of a free step after the rules (module docstring)."""
    scores = logits.clone()
    if rules.suppress:
        scores[list(rules.suppress)] = float("-inf")
    if len(sequence.tokens) == sequence.begin_index and rules.begin_suppress:
        scores[list(rules.begin_suppress)] = float("-inf")
    if sequence.is_timestamps and rules.no_timestamps is not None:
        _timestamp_rule(scores, sequence, rules.no_timestamps, rules)
    return scores


def _timestamp_rule(scores: torch.Tensor, sequence: WhisperSequence, no_timestamps: int,
                    rules: WhisperRules) -> None:
    begin = no_timestamps + 1
    scores[no_timestamps] = float("-inf")
    seq = sequence.tokens[sequence.begin_index:]
    last_was_timestamp = len(seq) >= 1 and seq[-1] >= begin
    penultimate_was_timestamp = len(seq) < 2 or seq[-2] >= begin
    if last_was_timestamp:
        if penultimate_was_timestamp:
            scores[begin:] = float("-inf")
        else:
            scores[:rules.eos] = float("-inf")
    timestamps = [t for t in seq if t >= begin]
    lowest = begin
    if timestamps:
        lowest = timestamps[-1] if last_was_timestamp and not penultimate_was_timestamp else timestamps[-1] + 1
    scores[begin:lowest] = float("-inf")
    if not seq:
        scores[:begin] = float("-inf")
        if rules.max_initial_timestamp_index is not None:
            scores[begin + rules.max_initial_timestamp_index + 1:] = float("-inf")
    logprobs = torch.log_softmax(scores.float(), dim=-1)
    if logprobs[begin:].logsumexp(dim=-1) > logprobs[:begin].max():
        scores[:begin] = float("-inf")
