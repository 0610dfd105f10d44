"""The step contract: plain data between the run loop and an engine, a step in, results out.

The scheduler and batch builder build `Step`s and touch no tensors; an engine (simulated or
torch) runs a step and answers with a `StepResult`. Keeping this interface narrow lets the
simulated engine and the real one plug into the same conductor and scheduler.

    caps = engine.caps                 # EngineCaps: what the engine can do, as data
    handle = engine.launch(step)       # starts the step; the host may compose step N+1 now
    result = engine.wait(handle)       # StepResult of that step

A step carries everything the plan decided for it (key, mixture mask, capture bucket, attention
route); an engine runs it as given and refuses one that disagrees with its plan row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, cast

# The seeds an engine takes: 64-bit (the device sampler holds them in int64; a seed of 10**30 failed
# its whole step).
SEED_RANGE = (-(2**63), 2**63)
# presence_penalty and frequency_penalty: OpenAI's range (a logit moved by at most 2 a count)
OUTPUT_PENALTY_RANGE = (-2.0, 2.0)
# logit_bias: OpenAI's range of a bias (-100 bans a token in effect, 100 all but forces it), and the
# most entries one request may carry (each is a host-to-device pair a step)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 1024
# temperature and repetition_penalty: the sampler's float32 arithmetic holds a finite logit finite
# within these (a temperature of 1e39 is infinite in float32, and a masked logit's -inf / inf NaN;
# a penalty of 1e-300 is 0, and a logit / 0 infinite: either row sampled token 0, silently). Far
# past any use: at a temperature of 10,000 every token is as likely as the next to 3 decimals.
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
# The most alternatives a request may ask log-probabilities of beside its sampled token's (vLLM's
# and OpenAI's chat limit; each is a host copy per token).
MAX_LOGPROBS = 20

# A sampled token's log-probability under the node's distribution (log-softmax of its logits,
# before any penalty, temperature, top-k or top-p), then the `logprobs` most likely tokens with
# theirs, most likely first: (logprob, ((token, logprob), ...)). Plain tuples: they cross ranks as
# they are (serve/ranks/wire.py).
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


def sampling_range_problem(temperature: Optional[float], top_k: Optional[int], top_p: Optional[float],
                           seed: Optional[int], repetition_penalty: Optional[float],
                           presence_penalty: Optional[float] = None,
                           frequency_penalty: Optional[float] = None,
                           logprobs: Optional[int] = None, min_tokens: Optional[int] = None,
                           max_tokens: Optional[int] = None, prompt_logprobs: Optional[int] = None, *,
                           show: Callable[[Any], str]) -> Optional[str]:
    """The first sampling setting outside the range an engine takes, said as the error to raise;
    None when all are in range (None for a setting: left at its default; min_tokens is held to
    max_tokens where that is given). The Python API checks it before a request is queued, the
    engine for requests that come another way. `show` writes a value into the message (the
    caller's `arg_types.shown`, which this module may not import): repr or str raised Python's
    ValueError on an integer past 4,300 digits, a seed of 10**5000 for one."""
    for name, value in (("temperature", temperature), ("top_p", top_p), ("repetition_penalty", repetition_penalty),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and not _is_finite(value):  # temperature=10**400 failed in the engine's float()
            return f"{name} must be a finite number, got {show(value)}"
    infinity = float("inf")
    checks: list[tuple[bool, str, Any]] = [
        (temperature is not None and temperature < 0, "temperature must be >= 0", temperature),
        (temperature is not None and temperature > MAX_TEMPERATURE,
         f"temperature must be at most {MAX_TEMPERATURE:g} (every token is about as likely past it)", temperature),
        (top_k is not None and top_k < 0, "top_k must be >= 0 (0: no limit)", top_k),
        (top_p is not None and not 0 < top_p <= 1, "top_p must be in (0, 1]", top_p),
        (seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1], "seed must be a 64-bit integer", seed),
        (repetition_penalty is not None and repetition_penalty <= 0, "repetition_penalty must be > 0",
         repetition_penalty),
        (repetition_penalty is not None and not (
            REPETITION_PENALTY_RANGE[0] <= repetition_penalty <= REPETITION_PENALTY_RANGE[1]),
         f"repetition_penalty must be in [{REPETITION_PENALTY_RANGE[0]:g}, {REPETITION_PENALTY_RANGE[1]:g}] "
         "(1 is none)", repetition_penalty),
        *((value is not None and not OUTPUT_PENALTY_RANGE[0] <= value <= OUTPUT_PENALTY_RANGE[1],
           f"{name} must be in [-2, 2]", value)
          for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty))),
        (logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS,
         f"logprobs must be in [0, {MAX_LOGPROBS}] (the alternatives beside the sampled token)", logprobs),
        (prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS,
         f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (the alternatives beside each prompt token)",
         prompt_logprobs),
        (min_tokens is not None and not 0 <= min_tokens <= (infinity if max_tokens is None else max_tokens),
         f"min_tokens must be in [0, max_tokens ({show(max_tokens)})]", min_tokens),
    ]
    return next((f"{message}, got {show(value)}" for is_bad, message, value in checks if is_bad), None)


def _is_finite(value: Any) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


@dataclass
class StepRow:
    """One request's share of a step."""

    request_id: str
    walk: str
    num_tokens: int  # tokens this row feeds this step (a prompt chunk, 1 for decode)
    context_len: int  # tokens already in this row's KV sequence before the step
    inputs: dict[str, Any] = field(default_factory=dict)  # input name -> value (token ids, tensors)
    loop_iter: int = 0  # iteration of the enclosing loop, 0 outside loops
    handle: Any = None  # the conductor's own reference to the row's place in its walk (engines ignore it)
    loop_count: int = 0  # iterations the enclosing loop runs for this request (its limit), 0 outside loops
    # A prompt cut into chunks (the plan's chunk_sizes): this step feeds inputs[chunk_start :
    # chunk_start + num_tokens] after the KV earlier chunks wrote; is_partial: not the last chunk,
    # so the engine writes KV and samples nothing (the row's outputs are empty).
    chunk_start: int = 0
    is_partial: bool = False


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
    # The step's guidance mode: some row's request requires guidance on the node (guidance_mode.py).
    # Its capture, if any, is a family of that mode or of both (CaptureFamily.guidance).
    is_guided: bool = False


@dataclass
class RowResult:
    request_id: str
    outputs: dict[str, Any] = field(default_factory=dict)  # output edge name -> value
    is_stop: bool = False  # the node's stop check fired for this row (e.g. a stop token)
    error: Optional[str] = None  # this row failed alone; the request ends with this reason
    # The error came from the request's own input (`values.RequestInputError`: its audio, its
    # prompt's media placeholders): the client's fault, which the server answers as a 400.
    is_input_fault: bool = False
    # The stop came from a limit, not the model: the node sampled the request's max_tokens (a
    # Whisper window's full sequence is no cut: long-form decoding goes on). A partition that
    # counts no tokens (Qwen3-TTS's Talker, Qwen3-Omni's) is cut so without the conductor's own
    # count seeing it: the request then ends "length".
    is_length: bool = False
    # The sampled token's log-probabilities, where its request asked for them (Request.logprobs)
    # and the call sends the token to the client as text; None otherwise. A class default, not a
    # field: a field is an assignment in every row's __init__, 3.3 bytecodes a row on the decode
    # columns' path (`mstar bench runner`) for what few rows carry; the engine sets it on those
    # rows, and serve/ranks/wire.py carries it across ranks beside the fields.
    logprobs = cast(Optional[TokenLogprobs], None)
    # The log-probabilities of the prompt tokens this row fed (a prompt or a chunk of one), each
    # given the tokens before it, where its request asked for them (Request.prompt_logprobs) and
    # the engine computes them on this call: one entry a fed token, in order; None for a
    # request's first prompt token (nothing precedes it). A class default, as `logprobs`.
    prompt_logprobs = cast(Optional[list[Optional[TokenLogprobs]]], None)


def row_stop(token: int, stop_tokens: Any, node_stops: Any, num_sampled: int,
             max_tokens: Optional[int]) -> tuple[bool, bool]:
    """(is_stop, is_length) of a row that sampled `token`, its request's `num_sampled`-th on the
    node: a stop token (the request's or the node's) is the model's stop; else reaching max_tokens
    cuts the row (the engines' one rule, so every engine says "length" alike)."""
    if token in stop_tokens or token in node_stops:
        return True, False
    is_cut = max_tokens is not None and num_sampled >= max_tokens
    return is_cut, is_cut


@dataclass
class StepResult:
    rows: list[RowResult]
    # Rows that could not get KV pages or state slots: nothing ran for them, they are held and
    # retried (the scheduler's out-of-memory hold). Never lost.
    allocation_failed: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    # The same answer in columns, for an engine that can give it (the simulator): one sampled
    # token id per row of `rows`, in order (a 1-D integer numpy array, or a list), where every row
    # of the step ran, answered in step order, with no error, and sampled exactly one token: its
    # outputs are `[token_ids[i]]` under each host output edge of its call. `stop_rows`: the
    # indices of the rows with is_stop. The conductor then advances the step's decode rows at once
    # (conductor/lane_pass.py). None: the conductor reads `rows` alone.
    token_ids: Optional[Any] = None
    stop_rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do, as data (the run loop reads these and never probes the engine).

    is_simulated:       `StepResult.elapsed_s` is modelled time: the run loop moves `clock` by it
                        (`clock` then needs `advance_to(when)`); else elapsed is wall time.
    runs_partial_steps: rows that got memory run beside the `allocation_failed` ones; else a step
                        with a failed row runs nothing (all or nothing).
    can_run_followers:  a TP follower's copy of a step costs time on this engine, so the run loop
                        launches it (a step with no rows); else followers cost nothing here.
    clock:              the run clock (seconds); None = wall time (`time.monotonic`).
    vocab_sizes:        decoder node -> how many token ids its model samples from, where that is
                        fewer than the plan's vocabulary (a stand-in: tiny dims, the simulator);
                        a stream `keep` range those ids cannot reach is not applied.
    can_launch_ahead:   the engine has `launch_ahead(worker, node, rows)`: right after step N
                        launched, the run loop names the rows of the speculated step N+1 and the
                        engine may start N+1 before N is waited for (the device runs ahead).
    image_sizes:        node -> (width, height) of every image its client image outputs carry,
                        for the nodes this engine knows it of (the server refuses an image
                        request's `size` that no such node makes); a node left out: unknown.
    rerun_nodes:        the nodes whose step, when it raises (not `EngineLost`), leaves each of
                        its rows' requests as it was before the step, or as a second run of the
                        row makes it again alike (KV written again at the same positions): the
                        run loop then runs each row of a failed step of several rows again in a
                        step of its own, and fails only the requests whose own step raises. A
                        node left out (recurrent state, which moves a token a run; a device
                        that runs steps ahead): a failed step fails all its requests.
    """

    is_simulated: bool = False
    runs_partial_steps: bool = True
    can_run_followers: bool = False
    clock: Optional[Callable[[], float]] = None
    vocab_sizes: dict[str, int] = field(default_factory=dict)
    can_launch_ahead: bool = False
    image_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    rerun_nodes: frozenset[str] = frozenset()


class EngineLost(Exception):
    """The engine can no longer run anything (a rank process exited or hangs): the run stops,
    and the requests still in it are reported failed with this message. Any other exception
    from an engine fails only the requests of the step that raised it."""


@dataclass
class StepHandle:
    """A launched step. `result` is set once the engine has it (at launch for engines that run a
    step at once, the CPU reference and the simulator); `pending` is engine-owned state of a step
    still running (a device event, for example)."""

    step: Step
    result: Optional[StepResult] = None
    pending: Any = None


class Engine(Protocol):
    """What the runtime needs from an engine."""

    caps: EngineCaps

    def add_request(self, request_id: str, spec: Any) -> Optional[str]:
        """Prepare per-request state; returns an error message if the request can never fit."""

    def launch(self, step: Step) -> StepHandle:
        """Start the step; it may still be running on return."""

    def wait(self, handle: StepHandle) -> StepResult:
        """The result of a launched step (blocks until it is done)."""

    def claim_prefix(self, request_id: str, node: str, tokens: list[int]) -> int:
        """The request's prompt `tokens` on a kv node with a prefix cache (KvPoolPlan.prefix_cache
        "pages"), before anything of it ran there: start its KV sequence on the cached pages of the
        longest cached prefix and answer how many tokens they hold (0: none; never all tokens)."""

    def end_request(self, request_id: str) -> None:
        """Free the request's KV pages and state slots."""

    def end_node(self, request_id: str, node: str) -> None:
        """The request runs nothing more on this node (every partition of it that calls the node
        has ended): free its KV pages and state slots there; the rest of the request goes on."""


@dataclass
class AheadChunks:
    """A speculated step's prompt chunks, for an engine launching it ahead: the rows of a prompt cut
    in the step launched last with chunks left, the rows new to the step outside loops (a prompt
    that arrived while the step launched last ran: its first chunk), and the step's shape (its key,
    capture family, token bucket and attention route, as the real step will carry them)."""

    key: str
    capture: Optional[str]
    token_bucket: int
    attention: str
    chunks: dict[str, int]  # request id -> tokens of its next chunk (it starts where its KV ends)
    # The new rows as the real step will carry them (the conductor's rows now: their inputs are
    # known on the host). An engine that launches one ahead claims it only when the real step's
    # row feeds the same tokens from the same start.
    fresh: list[StepRow] = field(default_factory=list)


class LaunchesAhead(Protocol):
    """An engine whose caps say `can_launch_ahead`."""

    def launch_ahead(self, worker: int, node: str, rows: list[tuple[str, str]],
                     chunks: Optional[AheadChunks] = None) -> None:
        """The worker's next step of `node` is speculated to run these (request id, walk) rows:
        start what of it can start before the step launched last was waited for. Nothing is
        promised: the real next step is still launched, and takes what this started. chunks: the
        rows among them that feed a prompt's next chunk, and the step's shape (None: none)."""


class RunsAtLaunch:
    """`launch`/`wait` for an engine whose `run_step(step) -> StepResult` runs a step at once
    (the CPU torch reference, the simulator): launch runs it, wait hands the result back.
    `run_step` is that engine's synchronous body; the run loop only calls launch and wait."""

    def run_step(self, step: Step) -> StepResult:
        raise NotImplementedError

    def launch(self, step: Step) -> StepHandle:
        return StepHandle(step, self.run_step(step))

    def wait(self, handle: StepHandle) -> StepResult:
        if handle.result is None:
            raise RuntimeError("wait on a step handle this engine never launched")
        return handle.result
