"""Runs Whisper's nodes: the audio encoder, and the decoder with its cross-attention pool.

Encoder (a stateless `audio_encoder` node with `style=whisper`): per row, the request's 16 kHz
samples (its `media prompt audio` input; seeded noise when the request brought none) -> log-mel
features (models/log_mel.py) -> encoder states `[1500, hidden]` under every output edge.

Decoder (a kv node with `style=whisper` and a `cross_kv` pool), one request at a time as the
reference runs it (no batching): the walks whose kv access writes the pool fill it from the pool's
source input (the plan's `cross_kv.source`: the encoder's states, never added to the token
embeddings), every call attends over it; token inputs extend the request's self-attention cache.
The first call starts the request's decoder sequence from its text prompt (runners/whisper_rules.py:
start of transcript, detected language, task, no timestamps); each call then yields one token, forced
by the start sequence or sampled from the logits after the suppression and timestamp rules. A row
stops at the end-of-text token, a request stop token, max_tokens, or the decoder's last position;
only max_tokens is a cut (`is_length`), after which no window follows (its `audio_left` is 0).
Out: per row its token under `tokens` outputs and its hidden states under other outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mstar.plan.schema import NodePlan
from mstar.runtime.engine.kv.reserved_pages import ReservedPages
from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.engine.models.log_mel import NUM_FRAMES, NUM_SAMPLES, log_mel, log_mel_frames
from mstar.runtime.engine.models.whisper import WhisperDecoder, WhisperEncoder, WhisperKv
from mstar.runtime.engine.runners.request_state import RequestState, output_tokens
from mstar.runtime.engine.runners.stateless import StatelessRunner
from mstar.runtime.engine.runners.values import InputError, RequestInputError, failed_row, input_error
from mstar.runtime.engine.runners.whisper_rules import WhisperRules, WhisperSequence, next_token, processed
from mstar.runtime.engine.runners.whisper_windows import AudioWindow, WindowError, closed_cut, segment_cut, window_of
from mstar.runtime.engine.sampling import draw_stream, sample_tokens
from mstar.runtime.step import RowResult, StepRow, row_stop

Rows = list[tuple[StepRow, CallInfo, RequestState]]


class WhisperEncoderRunner(StatelessRunner):
    def __init__(self, node: NodePlan, model: WhisperEncoder, position: int = 0):
        super().__init__(node, position)
        self.model = model
        # a long clip's log-mel features, computed at its first window and cut for each later one
        # (computed a window each, a clip's windows cost the square of its length: 1,200 s took 53 s
        # of features alone, inside the steps every other request waits for), until the request ends
        self._clip_features: dict[str, torch.Tensor] = {}

    def end_request(self, request_id: str) -> None:
        self._clip_features.pop(request_id, None)

    def row_outputs(self, row: StepRow, call: CallInfo, request: RequestState) -> dict[str, object]:
        """The window's states under `hidden`/`embeddings` outputs, the window itself
        (runners/whisper_windows.py) under `signal` outputs."""
        states, window = self.encode(row, call, request)
        return {name: window.to_signal() if call.output_roles.get(name) == "signal" else states
                for name in call.output_names}

    def row_failure(self, row: StepRow, error: Exception) -> RowResult:
        """A window the runner cannot use fails its row alone, as a bad input or a clip too long
        for the memory does (`StatelessRunner.row_failure`)."""
        if isinstance(error, WindowError):
            return failed_row(row.request_id, self.node.name, error)
        return super().row_failure(row, error)

    def encode(self, row: StepRow, call: CallInfo, request: RequestState) -> tuple[torch.Tensor, AudioWindow]:
        """The states of the window that starts where the row's `signal` input (the audio not yet
        transcribed; absent: the first window) says. A clip of at most 3000 frames is one window,
        padded to 30 s as samples; a longer one is cut from the whole clip's features."""
        name = call.input_with("media")
        raw = row.inputs.get(name) if name is not None else None
        if raw is None:  # no audio: 30 s of seeded noise (a stand-in, as for other media)
            samples = 0.1 * self._stand_in(request, call, "media", (NUM_SAMPLES,))
        else:
            samples = torch.as_tensor(raw, dtype=torch.float32)
            if samples.dim() != 1 or samples.numel() == 0:
                raise input_error(call, name, f"audio must be a non-empty 1-D tensor of 16 kHz samples, got "
                                              f"shape {tuple(samples.shape)}")
        left = call.input_with("signal")
        window = window_of(samples.numel(), row.inputs.get(left) if left is not None else None)
        bins = self.model.dims.num_mel_bins
        if not window.is_long_form:
            return self.model(log_mel(samples, bins)), window
        clip = self._clip_features.get(row.request_id)
        if clip is None or clip.shape[1] != window.total_frames:  # (another clip under the same request)
            clip = self._clip_features[row.request_id] = log_mel_frames(samples, bins)
        features = clip[:, window.start_frame:window.start_frame + window.num_frames]
        padded = torch.nn.functional.pad(features, (0, NUM_FRAMES - window.num_frames))
        return self.model(padded), window

    def compute(self, row: StepRow, call: CallInfo, request: RequestState) -> torch.Tensor:
        return self.encode(row, call, request)[0]


@dataclass
class _Decoding:
    """One request on the decoder: its caches and its decoder sequence (None before its first call)."""

    kv: WhisperKv
    sequence: Optional[WhisperSequence] = None
    window: Optional[AudioWindow] = None  # the encoder's window (absent: one window, no seeking)
    num_released: int = 0  # the window's generated tokens already handed out as transcript


class WhisperDecoderRunner:
    def __init__(self, node: NodePlan, model: WhisperDecoder, rules: WhisperRules, max_seq_len: int,
                 pages: ReservedPages, position: int = 0):
        """max_seq_len: the longest decoder sequence (the deployment's, within the position table);
        pages: the plan's pool, which admits requests though the KV is held per request."""
        self.node = node
        self.pages = pages
        self.model = model
        self.rules = rules
        self.max_seq_len = min(max_seq_len, model.dims.num_positions)
        self.position = position
        self.pools = {pool.label: pool for pool in node.cross_kv}
        self.fills = {a.walk: [label for label in a.writes if label in self.pools] for a in node.kv_access}
        self.sources = {pool.source for pool in node.cross_kv}
        self.requests: dict[str, _Decoding] = {}

    def attention_backend(self) -> str:
        return "torch"

    def refusal(self, request: RequestState) -> Optional[str]:
        params = request.params
        if params.logprobs is not None or params.logit_bias or params.ignore_eos or params.min_tokens:
            # (its timestamp rules sample from their own scores, and its own end token ends a window)
            return (f"node {self.node.name}: logprobs, logit_bias, ignore_eos and min_tokens are not taken on a "
                    "Whisper decoder")
        if len(request.prompt_tokens) >= self.max_seq_len:  # a longer run stops at the last position
            return (f"node {self.node.name}: the decoder prompt ({len(request.prompt_tokens)} tokens) leaves none "
                    f"of the decoder's {self.max_seq_len} positions to generate in")
        bad = next((t for t in request.prompt_tokens if not 0 <= t < self.model.dims.vocab), None)
        if bad is not None:
            vocab = self.model.dims.vocab
            return f"node {self.node.name}: prompt token id {bad} is outside the vocabulary [0, {vocab})"
        return self.pages.refusal(len(request.prompt_tokens), request.params.max_tokens)

    def end_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.pages.release(request_id)

    def run(self, rows: Rows, is_partial_ok: bool = False) -> tuple[list[RowResult], list[str]]:
        """Rows run one by one, once their requests' pages are reserved (kv/reserved_pages.py); the
        ids of the rows short of pages come back to be held and retried."""
        budgets = [(row.request_id, self.pages.budget_pages(len(request.prompt_tokens), request.params.max_tokens))
                   for row, _, request in rows]
        short = self.pages.admit(budgets, is_partial_ok)
        if short and not is_partial_ok:
            return [], short
        results = []
        for row, call, request in rows:
            if row.request_id in short:
                continue
            try:
                with torch.no_grad():
                    results.append(self._run_row(row, call, request))
            except (InputError, WindowError) as error:
                results.append(failed_row(row.request_id, self.node.name, error))
        return results, short

    def _run_row(self, row: StepRow, call: CallInfo, request: RequestState) -> RowResult:
        state = self.requests.get(row.request_id)
        fills = self.fills.get(row.walk, [])
        if state is None or (fills and state.sequence is not None):
            # A walk that fills the pool again starts the next window: a new decoder sequence over
            # the new states, from the first window's start sequence (its language detected once).
            first = state.sequence if state is not None else None
            state = self.requests[row.request_id] = _Decoding(self.model.empty_kv())
            if first is not None:
                state.sequence = first.restarted()
        for label in fills:
            state.kv.cross = self.model.cross_pool(self._states(row, label))
        if state.kv.cross is None:
            raise InputError(f"walk {row.walk} reads the cross-attention pool before a walk filled it")
        window = call.input_with("signal")
        if window is not None and row.inputs.get(window) is not None:
            state.window = AudioWindow.of_signal(row.inputs[window])
        is_long_form = state.window is not None and state.window.is_long_form
        if is_long_form and self.rules.no_timestamps is None:
            raise RequestInputError("audio past 30 s is transcribed window by window with timestamps, and this "
                                    "decoder's rules have no <|notimestamps|> token to place them")
        fed = self._tokens(row, call)
        if state.sequence is None:
            state.sequence = WhisperSequence.start(fed, self.rules, is_long_form)
            fed = state.sequence.tokens
        elif state.kv.num_tokens == 0:  # a restarted window feeds its start sequence at once
            fed = state.sequence.tokens
        if state.kv.num_tokens + len(fed) > self.max_seq_len:
            raise InputError(f"the decoder sequence would pass its {self.max_seq_len} positions")
        hidden = self.model(torch.tensor(fed, dtype=torch.long), state.kv)
        token = self._next(self.model.logits(hidden[-1]), state.sequence, request)
        state.sequence.tokens.append(token)
        return self._result(row, call, request, token, hidden, state)

    def _transcript(self, state: _Decoding, token: int, is_end: bool) -> tuple[list[int], int]:
        """(the tokens that became final with this step, samples of audio left after the window as
        if it ended now). One window: every token as sampled, nothing left. Long form: the window's
        segments once closed, the rest at its end (runners/whisper_windows.py), without the start
        sequence or end of text."""
        window, sequence = state.window, state.sequence
        assert sequence is not None
        if window is None or not window.is_long_form or self.rules.no_timestamps is None:
            return [token], 0
        generated = sequence.tokens[sequence.begin_index:]
        if generated[-1:] == [self.rules.eos]:
            generated = generated[:-1]
        begin = self.rules.no_timestamps + 1
        cut, offset = segment_cut(generated, begin, window)
        if not is_end:
            cut = closed_cut(generated, begin)
        released = generated[state.num_released:cut]
        state.num_released = max(state.num_released, cut)
        return released, window.left_after(offset)

    def _states(self, row: StepRow, label: str) -> torch.Tensor:
        pool = self.pools[label]
        states = row.inputs.get(pool.source)
        if not isinstance(states, torch.Tensor) or states.dim() != 2 or states.shape[1] != self.model.dims.hidden:
            raise InputError(f"cross_kv {label} is filled from {pool.source}: expected states of shape "
                             f"[n, {self.model.dims.hidden}], got {_shape(states)}")
        if states.shape[0] > pool.num_tokens:
            raise InputError(f"cross_kv {label} holds {pool.num_tokens} states, {pool.source} brings "
                             f"{states.shape[0]}")
        return states.float()

    def _tokens(self, row: StepRow, call: CallInfo) -> list[int]:
        """The row's token ids (its token inputs that do not fill a pool); [] for an empty prompt."""
        tokens: list[int] = []
        for name in call.inputs:
            if name in self.sources or call.input_roles.get(name) != "tokens":
                continue
            value = row.inputs.get(name)
            if isinstance(value, torch.Tensor):
                value = value.reshape(-1).tolist()
            if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                tokens.extend(value)
            elif value is not None:
                raise InputError(f"input {name} must be token ids, got {type(value).__name__}")
        return tokens

    def _next(self, logits: torch.Tensor, sequence: WhisperSequence, request: RequestState) -> int:
        forced = next_token(logits, sequence, self.rules)
        if forced is not None:
            return forced
        node = self.node.name
        scores = processed(logits, sequence, self.rules).unsqueeze(0)
        history = torch.tensor(sequence.tokens, dtype=torch.long)
        return sample_tokens(scores, [request.params], [history], [draw_stream(request.params.seed, self.position)],
                             [request.num_sampled.get(node, 0)], output_tokens([request], node))[0]

    def _result(self, row: StepRow, call: CallInfo, request: RequestState, token: int, hidden: torch.Tensor,
                state: _Decoding) -> RowResult:
        node = self.node.name
        num_sampled = request.count_sampled(node, token)
        length = len(state.sequence.tokens) if state.sequence is not None else 0
        result = RowResult(row.request_id)
        # a window's sequence full is its end (long-form decoding goes on to the next), not a cut
        result.is_stop, result.is_length = row_stop(token, request.params.stop_tokens, (self.rules.eos,),
                                                    num_sampled, request.params.max_tokens)
        result.is_stop = result.is_stop or length >= self.max_seq_len
        released, audio_left = self._transcript(state, token, result.is_stop)
        if result.is_length:  # the request's max_tokens cut it: no window after this one (a full one goes on)
            audio_left = 0
        for name in call.output_names:
            role = call.output_roles.get(name, "tokens")
            if role == "tokens":
                result.outputs[name] = [token]
            elif role == "transcript":
                result.outputs[name] = released
            elif role == "signal":
                result.outputs[name] = audio_left
            else:
                result.outputs[name] = hidden.clone()
        return result


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
