"""Workloads: generated request traces, or requests read from a JSONL file.

Generated (`generate`): `num_requests` requests with prompt and output lengths drawn uniformly
from inclusive ranges (the output length is the request's max_tokens), token ids drawn from a
small vocabulary, all from one seed. Arrivals:
- poisson: exponential gaps at `rate` requests/s;
- staggered: one request every 1/rate s;
- closed: `concurrency` clients, each sending its next request when its previous one finishes.

File (`read_prompts`): one JSON object per line: {"id": str, "max_tokens": int} with the prompt as
exactly one of "prompt_tokens" ([int, ...]), "prompt" (text, tokenized by the run's tokenizer) or
"messages" ([{"role": str, "content": str}, ...], rendered by the tokenizer's chat template, then
tokenized), and optionally "audio" (a 16 kHz WAV file, relative to the prompts file's folder; read
by serve/wav.py into the request's audio media; a line with audio may leave the text prompt out,
which gives an empty one, e.g. for Whisper's decoder, or, with the plan's prompt_format and a
tokenizer, that frame around empty text, e.g. Qwen3-ASR's chat turns; refused for a plan whose audio
input takes feature frames, `takes_wav`), "stop" (a string or a list of strings: the
request ends once its decoded output holds one; needs the tokenizer too), "temperature", "top_k", "top_p",
"seed" (64-bit; a line without one samples with --seed x 1000003 + its place among the requests),
"repetition_penalty" (in [1e-4, 1e4]), "presence_penalty" and "frequency_penalty" (in [-2, 2]),
"stop_tokens" ([int, ...]), "route" ({partition: [walk, ...]}, see
Request.route), "guidance" ({label: scale >= 0}, image-flow guidance by the spec's guidance
labels, see mstar/runtime/engine/runners/guidance.py), "loop_counts" ({param: iterations >= 1}, for
loops written `count=PARAM`, each within its loop's max), "logprobs" (0 to 20: each output text
token's log-probability and that many alternatives', in outputs.jsonl), "prompt_logprobs" (0 to
20: the same of each prompt token given the tokens before it, in outputs.jsonl; no cached prefix
claimed), "logit_bias" ({token id:
bias in [-100, 100]}, OpenAI's, on the calls that send tokens as text), "ignore_eos" (true: the
model's own stop tokens do not end it) and "min_tokens" (no stop token before that many), vLLM's;
blank lines are skipped. Given the plan,
a line's guidance labels and loop counts are checked against it as the file is read, by the rules
the engine and the conductor apply at admission (`unknown_label_problem`, `LoopCounts`). An id is 1 to
MAX_ID_CHARS characters of [A-Za-z0-9._:@+=-] (it names the request's files under --out; no path
separator, NUL or space). The file is read through mstar.files.read_bytes_bounded: a regular file
of at most MAX_PROMPTS_BYTES (a FIFO or /dev/zero is refused at once). Every request arrives at
time 0 (or through the closed loop when a concurrency is given). A bad line raises WorkloadError
naming the file, the line and what is wrong.

Routes (`check_route`): given the plan's `route_names` ({partition: walks of its stages}), a
route naming an unknown partition or a walk outside that partition's stages, or leaving every
partition out, is a WorkloadError (with a "did you mean" when a known name is close), found before
anything runs; `route_name_problem` words it, for the Python API's check too (plan_checks.py).
"""
from __future__ import annotations

import difflib
import json
import math
import os
import random
import re
from typing import Any, Collection, Optional

from mstar.arg_types import INTEGER, read_int, shown, shown_path
from mstar.files import MAX_PROMPTS_BYTES, InputFileError, read_bytes_bounded
from mstar.plan.guidance_mode import unknown_label_problem
from mstar.plan.output_bound import excess_tokens_problem
from mstar.plan.request_fields import LINE_FIELDS
from mstar.runtime.conductor.loop_counts import LoopCounts
from mstar.runtime.serve.driver import Workload
from mstar.runtime.serve.endpoints import prompt_modalities
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.text_offer import TextOffer
from mstar.runtime.engine.prompt_limits import stop_token_problem, stop_vocab
from mstar.runtime.step import MAX_LOGPROBS, OUTPUT_PENALTY_RANGE, SEED_RANGE, sampling_range_problem

ARRIVALS = ("poisson", "staggered", "closed")
VOCAB_SIZE = 1000
# a generated workload is built in memory before the run starts: bound it so a typo (an extra
# zero or ten) is refused at once instead of filling memory
MAX_GENERATED_REQUESTS = 10_000_000
MAX_GENERATED_PROMPT_LEN = 1_000_000
MAX_GENERATED_OUTPUT_LEN = 1_000_000
# prompt tokens a generated workload may hold, expected (--requests x the middle of --prompt-len):
# a token is about 36 bytes as a Python int in a list, so this is about 3.6 GB; 1,000 prompts of
# 10**6 tokens grew past 12 GB before the run refused every one of them
MAX_GENERATED_PROMPT_TOKENS = 100_000_000
MAX_ARRIVAL_SPAN_S = 86_400.0  # a torch run waits for each arrival in wall time: a tiny --rate waited forever
MAX_ID_CHARS = 128
ID_PATTERN = re.compile(r"[A-Za-z0-9._:@+=-]+")


class WorkloadError(Exception):
    """Bad workload input (a range, an arrival kind, a prompts file line)."""


def parse_range(text: str, what: str, most: Optional[int] = None) -> tuple[int, int]:
    """`A..B` (or a single `N`) -> (A, B) with 1 <= A <= B (<= `most` tokens, when given)."""
    parts = text.split("..")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        if len(parts) <= 2 and all(INTEGER.fullmatch(part) for part in parts):
            raise WorkloadError(_unreadable_integer(parts, what, most)) from None
        raise WorkloadError(f"{what}: expected A..B or N with integers, got {shown(text)}") from None
    if low < 1 or high < low:
        raise WorkloadError(f"{what}: need 1 <= A <= B, got {shown(text)}")
    if most is not None and high > most:
        raise WorkloadError(f"{what} must be at most {most} tokens, got {shown(high)}")
    return low, high


def _unreadable_integer(parts: list[str], what: str, most: Optional[int]) -> str:
    """What is wrong with a range of integers past Python's digit limit (4300), which int() does not
    read: too large (or too small), not "not integers"; the integer echoed as `shown` clips it."""
    text = next(part.strip() for part in parts if _is_unreadable(part))
    digits = shown(read_int(text))
    if text.startswith("-"):
        return f"{what}: need 1 <= A <= B, got {digits}"
    return f"{what} must be at most {most} tokens, got {digits}" if most is not None else \
        f"{what}: {digits} is too large"


def _is_unreadable(part: str) -> bool:
    try:
        int(part)
    except ValueError:
        return True
    return False


def parse_route(items: list[str]) -> dict[str, list[str]]:
    """`--route PARTITION=WALK,WALK` items -> {partition: [walks]} (an empty list after `=`
    leaves the partition out)."""
    route: dict[str, list[str]] = {}
    for item in items:
        partition, sep, walks = item.partition("=")
        partition = partition.strip()
        if not sep or not partition:
            raise WorkloadError(f"--route: expected PARTITION=WALK,WALK, got {shown(item)}")
        if partition in route:  # (the last one was taken, the first silently dropped)
            raise WorkloadError(f"--route: partition {shown(partition)} is given twice; give its walks once, "
                                "PARTITION=WALK,WALK")
        route[partition] = [w.strip() for w in walks.split(",") if w.strip()]
    return route


def route_names(plan: Any) -> dict[str, list[str]]:
    """A plan -> {partition name: the walks of its stages, in stage order}."""
    return {part.name: [w for stage in part.stages for w in stage.walks] for part in plan.partitions}


def starting_partitions(plan: Any) -> set[str]:
    """The partitions a request starts by their initial walk; the others start only from streams
    other partitions send them (Orpheus's SNAC, Qwen3-Omni's Talker and Code2Wav)."""
    return {part.name for part in plan.partitions if part.initial_walk is not None}


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_route(route: dict[str, list[str]], names: dict[str, list[str]], where: str,
                starters: Collection[str] = ()) -> None:
    """Raise WorkloadError (prefixed by `where`) when `route` names a partition or walk that
    `names` (from `route_names`) does not have, or leaves out every partition of `starters`
    (`starting_partitions`). Stage order is left to the conductor."""
    problem = route_name_problem(route, names, starters)
    if problem is not None:
        raise WorkloadError(f"{where}: {problem}")


def route_name_problem(route: dict[str, list[str]], names: dict[str, list[str]],
                       starters: Collection[str] = ()) -> Optional[str]:
    """What `check_route` refuses, in words (also the Python API's and the server's, through
    plan_checks.py `PlanChecks.route_problem`), else None."""
    for partition, walks in route.items():
        if partition not in names:
            return (f"unknown partition {shown(partition)}{_did_you_mean(partition, list(names))}"
                    f" (partitions: {', '.join(sorted(names))})")
        for walk in walks:
            if walk not in names[partition]:
                return (f"partition {partition!r} has no walk {shown(walk)}"
                        f"{_did_you_mean(walk, names[partition])} (walks: {', '.join(names[partition])})")
    if names and all(not route.get(partition, [None]) for partition in names):
        return (f"the route leaves every partition out ({', '.join(names)}), so a request would run nothing; "
                "name a walk for at least one")
    if starters and all(not route.get(partition, [None]) for partition in starters):
        # (the others start only from their streams: the request ran nothing and ended `stop`)
        others = sorted(set(names) - set(starters))
        return (f"the route leaves out every partition a request starts ({', '.join(sorted(starters))}; "
                f"{', '.join(others)} {'starts' if len(others) == 1 else 'start'} only from streams), so a "
                "request would run nothing; name a walk for one of them")
    return None


def generate(
    num_requests: int,
    *,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    arrival: str = "closed",
    concurrency: int = 8,
    rate: float = 100.0,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
    max_output_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> Workload:
    """vocab_size: prompt ids are drawn below it (the plan's text vocabulary when smaller than
    VOCAB_SIZE: a plan of 100 tokens refused every request drawn below 1000). max_output_len: the
    most output tokens the plan makes for a request (plan/output_bound.py), None when unstated.
    max_seq_len: the tokens a request may reach (prompt + max_tokens); a workload whose every
    request would pass it is refused before any is drawn."""
    if arrival not in ARRIVALS:
        raise WorkloadError(f"--arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    if num_requests < 0:
        raise WorkloadError(f"--requests must be >= 0, got {shown(num_requests)}")
    if num_requests > MAX_GENERATED_REQUESTS:
        raise WorkloadError(f"--requests must be at most {MAX_GENERATED_REQUESTS}, got {shown(num_requests)}")
    _check_lengths(prompt_len, output_len)
    excess = excess_tokens_problem("--output-len", output_len[1], max_output_len)
    if excess is not None:
        raise WorkloadError(excess)
    if concurrency < 1:
        raise WorkloadError(f"--concurrency must be >= 1, got {shown(concurrency)}")
    if not rate > 0:  # also NaN, which no comparison accepts
        raise WorkloadError(f"--rate must be > 0, got {rate}")
    _check_size(num_requests, prompt_len, output_len, arrival, rate, max_seq_len)
    rng = random.Random(seed)
    requests = []
    now = 0.0
    for index in range(num_requests):
        num_prompt = rng.randint(*prompt_len)
        prompt = [rng.randrange(vocab_size) for _ in range(num_prompt)]
        if arrival == "poisson":
            now += rng.expovariate(rate)
        elif arrival == "staggered":
            now = index / rate
        requests.append(
            Request(
                id=f"req-{index:06d}",
                prompt_tokens=prompt,
                max_tokens=rng.randint(*output_len),
                seed=seed * 1_000_003 + index,
                arrival_s=now if arrival != "closed" else 0.0,
            )
        )
    if now > MAX_ARRIVAL_SPAN_S:
        raise WorkloadError(f"--rate {rate} spreads {num_requests} requests' arrivals over {now:.3g} s, more than "
                            f"{MAX_ARRIVAL_SPAN_S:.0f} s (a day); raise --rate")
    return Workload(requests, closed_concurrency=concurrency if arrival == "closed" else None)


def _check_lengths(prompt_len: tuple[int, int], output_len: tuple[int, int]) -> None:
    if prompt_len[1] > MAX_GENERATED_PROMPT_LEN:
        raise WorkloadError(f"--prompt-len must be at most {MAX_GENERATED_PROMPT_LEN} tokens, got "
                            f"{shown(prompt_len[1])}")
    if output_len[1] > MAX_GENERATED_OUTPUT_LEN:
        raise WorkloadError(f"--output-len must be at most {MAX_GENERATED_OUTPUT_LEN} tokens, got "
                            f"{shown(output_len[1])}")


def _check_size(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], arrival: str,
                rate: float, max_seq_len: Optional[int]) -> None:
    """What `generate` can tell before it draws anything: the workload's size in memory, every
    request past the plan's length, and a staggered arrival span past a day (found only after
    building, seconds and gigabytes later)."""
    if num_requests * (prompt_len[0] + prompt_len[1]) / 2 > MAX_GENERATED_PROMPT_TOKENS:
        raise WorkloadError(f"--requests {num_requests} of {prompt_len[0]}..{prompt_len[1]} prompt tokens is past the "
                            f"{MAX_GENERATED_PROMPT_TOKENS:,} tokens a generated workload may hold")
    if max_seq_len is not None and num_requests and prompt_len[0] + output_len[0] > max_seq_len:
        raise WorkloadError(f"--prompt-len {prompt_len[0]}.. and --output-len {output_len[0]}.. make every request "
                            f"longer than the plan's {max_seq_len} tokens (prompt + max_tokens)")
    if arrival == "staggered" and (num_requests - 1) / rate > MAX_ARRIVAL_SPAN_S:
        raise WorkloadError(f"--rate {rate} spreads {num_requests} requests' arrivals over "
                            f"{(num_requests - 1) / rate:.3g} s, more than {MAX_ARRIVAL_SPAN_S:.0f} s (a day); "
                            "raise --rate")


def _field(obj: dict[str, Any], name: str, kinds: tuple, where: str, *, is_required: bool) -> Any:
    if name not in obj:
        if is_required:
            raise WorkloadError(f"{where}: missing required field {name!r}")
        return None
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind_names = " or ".join(k.__name__ for k in kinds)
        raise WorkloadError(f"{where}: field {name!r} must be {kind_names}, got {shown(value)}")
    if float in kinds:
        try:
            is_finite = math.isfinite(value)
        except OverflowError:  # an int past the float range
            is_finite = False
        if not is_finite:
            said = value if isinstance(value, float) else f"a {len(str(value))}-digit integer"
            raise WorkloadError(f"{where}: field {name!r} must be a finite number, got {said}")
    return value


def _check_id(request_id: str, where: str) -> None:
    if not 1 <= len(request_id) <= MAX_ID_CHARS:
        raise WorkloadError(f"{where}: 'id' must be 1 to {MAX_ID_CHARS} characters, got {len(request_id)}")
    if not ID_PATTERN.fullmatch(request_id):
        bad = next(c for c in request_id if not ID_PATTERN.fullmatch(c))
        raise WorkloadError(f"{where}: 'id' may hold only letters, digits and . _ : @ + = - "
                            f"(it names the request's output files), got {bad!r} in {request_id[:40]!r}")


def _sampling_fields(obj: dict, where: str) -> dict[str, Any]:
    """temperature, top_k, top_p, seed and the penalties of a prompt line, checked."""
    temperature = _field(obj, "temperature", (int, float), where, is_required=False)
    if temperature is not None and temperature < 0:
        raise WorkloadError(f"{where}: 'temperature' must be >= 0, got {shown(temperature)}")
    top_k = _field(obj, "top_k", (int,), where, is_required=False)
    if top_k is not None and top_k < 0:
        raise WorkloadError(f"{where}: 'top_k' must be >= 0 (0: no limit), got {shown(top_k)}")
    top_p = _field(obj, "top_p", (int, float), where, is_required=False)
    if top_p is not None and not 0 < top_p <= 1:
        raise WorkloadError(f"{where}: 'top_p' must be in (0, 1], got {shown(top_p)}")
    penalty = _field(obj, "repetition_penalty", (int, float), where, is_required=False)
    if penalty is not None and not penalty > 0:
        raise WorkloadError(f"{where}: 'repetition_penalty' must be > 0, got {shown(penalty)}")
    output_penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _field(obj, name, (int, float), where, is_required=False)
        if value is not None and not OUTPUT_PENALTY_RANGE[0] <= value <= OUTPUT_PENALTY_RANGE[1]:
            raise WorkloadError(f"{where}: {name!r} must be in [-2, 2], got {shown(value)}")
        output_penalties[name] = float(value) if value is not None else None
    seed = _field(obj, "seed", (int,), where, is_required=False)
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:  # the engines' sampler holds int64
        raise WorkloadError(f"{where}: 'seed' must be a 64-bit integer (-2**63 to 2**63 - 1), got {shown(seed)}")
    # The rest of the ranges the engines take (temperature at most 10,000, repetition_penalty within
    # [1e-4, 1e4]): the simulated engine samples nothing and ran past them with exit 0.
    problem = sampling_range_problem(temperature, top_k, top_p, seed, penalty, output_penalties["presence_penalty"],
                                     output_penalties["frequency_penalty"], show=shown)
    if problem is not None:
        raise WorkloadError(f"{where}: {problem}")
    return {
        "temperature": float(temperature) if temperature is not None else None,
        "top_k": top_k,
        "top_p": float(top_p) if top_p is not None else None,
        "seed": seed,
        "repetition_penalty": float(penalty) if penalty is not None else None,
        **output_penalties,
    }


def _prompt_tokens(obj: dict, where: str, tokenizer: Any, form: Any = None) -> list[int]:
    """The line's prompt as token ids, from exactly one of prompt_tokens, prompt and messages
    (none at all on a line with audio: an empty prompt); `form`: the plan's prompt format
    (serve/prompt_format.py), which frames a text prompt."""
    given = [name for name in ("prompt_tokens", "prompt", "messages") if name in obj]
    if not given and "audio" in obj:
        # an empty prompt (Whisper's decoder starts its own), or the plan's frame around no text
        # (Qwen3-ASR's chat turns around the audio placeholder) where a tokenizer can render it
        return _framed(form, tokenizer, "", obj, where) if form is not None and tokenizer is not None else []
    if not given:
        raise WorkloadError(f"{where}: missing required field 'prompt_tokens' (or 'prompt' text, or 'messages' chat)")
    if len(given) != 1:
        raise WorkloadError(f"{where}: give the prompt as exactly one of 'prompt_tokens', 'prompt' (text) or "
                            f"'messages' (chat), got {given}")
    if given[0] == "prompt_tokens":
        tokens = _field(obj, "prompt_tokens", (list,), where, is_required=True)
        if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise WorkloadError(f"{where}: 'prompt_tokens' must be a non-empty list of non-negative integers")
        framing = sorted(set(obj) & set(form.fields)) if form is not None else []
        if framing:  # (it was ignored, whatever its value: `"voice": 5` ran)
            raise WorkloadError(f"{where}: {framing[0]!r} is a field of the plan's prompt format, which frames "
                                "a text 'prompt'; 'prompt_tokens' are taken as they are")
        return list(tokens)
    from mstar.runtime.serve.prompt_format import PromptFormatError
    from mstar.runtime.serve.tokenizer import HOW_TO_ADD, TokenizerError

    if tokenizer is None:
        raise WorkloadError(f"{where}: {given[0]!r} is text, and this run has no tokenizer to turn it into "
                            f"tokens: {HOW_TO_ADD}")
    try:
        if given[0] == "prompt":
            text = _field(obj, "prompt", (str,), where, is_required=True)
            if not text:
                raise WorkloadError(f"{where}: 'prompt' must be non-empty text")
            tokens = tokenizer.encode(text) if form is None else _framed(form, tokenizer, text, obj, where)
        elif form is not None:
            raise WorkloadError(f"{where}: this model frames a text 'prompt' by its prompt format "
                                f"({form.template!r}); it takes no chat 'messages'")
        else:
            tokens = tokenizer.encode_chat(_messages(obj, where))
    except (TokenizerError, PromptFormatError) as error:
        raise WorkloadError(f"{where}: {error}") from None
    if not tokens:
        raise WorkloadError(f"{where}: the prompt tokenizes to no tokens")
    return tokens


def _framed(form: Any, tokenizer: Any, text: str, obj: dict, where: str) -> list[int]:
    from mstar.runtime.serve.prompt_format import PromptFormatError, format_prompt
    from mstar.runtime.serve.tokenizer import TokenizerError

    try:
        return format_prompt(form, tokenizer, text, obj)
    except (TokenizerError, PromptFormatError) as error:
        raise WorkloadError(f"{where}: {error}") from None


def _messages(obj: dict, where: str) -> list[dict[str, Any]]:
    messages = _field(obj, "messages", (list,), where, is_required=True)
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise WorkloadError(f"{where}: 'messages' must be a non-empty list of objects with a 'role' and a "
                            "'content' string each")
    return messages


def _stop_strings(obj: dict, where: str, tokenizer: Any) -> list[str]:
    stop = _field(obj, "stop", (str, list), where, is_required=False)
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stops):
        raise WorkloadError(f"{where}: 'stop' must be a non-empty string or a list of non-empty strings")
    from mstar.runtime.serve.tokenizer import stop_strings_problem

    problem = stop_strings_problem(stops)
    if problem is not None:
        raise WorkloadError(f"{where}: {problem}")
    if stops and tokenizer is None:
        from mstar.runtime.serve.tokenizer import HOW_TO_ADD

        raise WorkloadError(f"{where}: 'stop' strings are matched in the decoded text, and this run has no "
                            f"tokenizer: {HOW_TO_ADD}")
    return list(stops)


def _audio(obj: dict, where: str, base_dir: str) -> dict[str, Any]:
    """The line's media: {"audio": samples} from its `audio` WAV path, else {}."""
    path = _field(obj, "audio", (str,), where, is_required=False)
    if path is None:
        return {}
    from mstar.runtime.serve.wav import WavError, read_wav

    try:
        return {"audio": read_wav(os.path.join(base_dir, path))}
    except WavError as error:
        raise WorkloadError(f"{where}: {error}") from None
    except MemoryError:  # (the command said "out of memory" without naming the line or the file)
        raise WorkloadError(f"{where}: audio file {shown_path(path)}: out of memory decoding it (shorten the "
                            "clip, or give the run more memory)") from None


def parse_prompt_line(line: str, where: str, tokenizer: Any = None, form: Any = None,
                      base_dir: str = ".") -> Request:
    """One prompts line -> a Request; `tokenizer` (serve/tokenizer.py TextTokenizer, or None)
    turns 'prompt' and 'messages' into tokens; `form` (the plan's PromptFormatPlan, or None)
    frames a text prompt, and its fields (e.g. 'voice') are fields of the line; `base_dir`: where
    relative `audio` paths start."""
    obj = _line_object(line, where)
    known = LINE_FIELDS | set(form.fields if form else ())
    unknown = sorted(set(obj) - known)
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) [{', '.join(shown(name) for name in unknown)}]; "
                            f"allowed: {sorted(known)}")
    request_id = _field(obj, "id", (str,), where, is_required=True)
    _check_id(request_id, where)
    tokens = _prompt_tokens(obj, where, tokenizer, form)
    max_tokens = _field(obj, "max_tokens", (int,), where, is_required=True)
    if max_tokens < 1:
        raise WorkloadError(f"{where}: 'max_tokens' must be >= 1, got {shown(max_tokens)}")
    stop_tokens = _field(obj, "stop_tokens", (list,), where, is_required=False) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_tokens):
        raise WorkloadError(f"{where}: 'stop_tokens' must be a list of non-negative integers")
    guidance = _field(obj, "guidance", (dict,), where, is_required=False) or {}
    scales = {}
    for label, scale in guidance.items():
        scale = _field(guidance, label, (int, float), f"{where}: 'guidance'", is_required=True)
        if scale < 0:
            raise WorkloadError(f"{where}: guidance scale of {shown(label)} must be >= 0, got {shown(scale)}")
        scales[label] = float(scale)
    loop_counts = _field(obj, "loop_counts", (dict,), where, is_required=False) or {}
    for name, count in loop_counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise WorkloadError(f"{where}: 'loop_counts' maps a loop's count param to a positive integer; "
                                f"{shown(name)} has {shown(count)}")
    route = _field(obj, "route", (dict,), where, is_required=False) or {}
    for walks in route.values():
        if not isinstance(walks, list) or not all(isinstance(w, str) for w in walks):
            raise WorkloadError(f"{where}: 'route' must map partition names to lists of walk names")
    return Request(
        id=request_id,
        prompt_tokens=list(tokens),
        max_tokens=max_tokens,
        **_sampling_fields(obj, where),
        stop_tokens=list(stop_tokens),
        stop_strings=_stop_strings(obj, where, tokenizer),
        route=route,
        guidance=scales,
        media=_audio(obj, where, base_dir),
        loop_counts=dict(loop_counts),
        logprobs=_logprobs(obj, where),
        prompt_logprobs=_logprobs(obj, where, "prompt_logprobs", "each prompt token"),
        logit_bias=_logit_bias(obj, where),
        **_stop_extensions(obj, where, max_tokens),
    )


def _line_object(line: str, where: str) -> dict:
    """A prompts line's JSON object (WorkloadError naming what is wrong with it)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as error:
        raise WorkloadError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    except ValueError:  # an integer literal past Python's digit limit (4300 by default)
        raise WorkloadError(f"{where}: a number on this line has too many digits to read") from None
    except RecursionError:  # arrays or objects nested past the interpreter's recursion limit
        raise WorkloadError(f"{where}: the line's JSON is nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _stop_extensions(obj: dict, where: str, max_tokens: int) -> dict[str, Any]:
    """ignore_eos and min_tokens of a prompts line (vLLM's; Request's fields), checked."""
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):  # (`_field` takes no booleans: they are ints to isinstance)
        raise WorkloadError(f"{where}: field 'ignore_eos' must be true or false, got {shown(ignore_eos)}")
    min_tokens = _field(obj, "min_tokens", (int,), where, is_required=False)
    if min_tokens is not None and not 0 <= min_tokens <= max_tokens:
        raise WorkloadError(f"{where}: 'min_tokens' must be in [0, max_tokens ({max_tokens})], got {shown(min_tokens)}")
    return {"ignore_eos": ignore_eos, "min_tokens": min_tokens or 0}


def _logit_bias(obj: dict, where: str) -> list[tuple[int, float]]:
    from mstar.runtime.engine.sampling import SamplingError, logit_bias_pairs

    biases = _field(obj, "logit_bias", (dict,), where, is_required=False) or {}
    try:
        return list(logit_bias_pairs(biases))
    except SamplingError as error:
        raise WorkloadError(f"{where}: {error}") from None


def _logprobs(obj: dict, where: str, name: str = "logprobs", beside: str = "each token") -> Optional[int]:
    logprobs = _field(obj, name, (int,), where, is_required=False)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise WorkloadError(f"{where}: '{name}' (the alternatives beside {beside}) must be in "
                            f"[0, {MAX_LOGPROBS}], got {shown(logprobs)}")
    return logprobs


def plan_problem(request: Request, plan: Any, counts: Optional[LoopCounts] = None,
                 offer: Optional[TextOffer] = None) -> Optional[str]:
    """A request's guidance label the plan does not declare (the torch engine's admission check;
    the sim ran it, exit 0), loop count the plan does not take (a name no loop counts by, or a
    count past its loop's max: the conductor's admission check), stop token id no kv node can
    sample, or log-probabilities the plan does not give (on Orpheus `logprobs` came back `[]` and
    `prompt_logprobs` failed the request once it ran) or a logit_bias or ignore_eos it would ignore,
    else None. `counts`, `offer`: the plan's `LoopCounts` and `TextOffer`, built once per file."""
    problem = unknown_label_problem(plan, request.guidance)
    if problem is None and request.loop_counts:
        problem = (counts or LoopCounts(plan)).problem(request.loop_counts)
    if problem is None and request.stop_tokens:  # (the Python API refuses it; the file's line ran)
        problem = stop_token_problem(stop_vocab(plan), request.stop_tokens, "'stop_tokens'")
    if problem is None and (request.logprobs is not None or request.prompt_logprobs is not None
                            or request.logit_bias or request.ignore_eos):
        offer = offer or TextOffer(plan)
        problem = (offer.logprobs_problem(request.logprobs) or offer.prompt_logprobs_problem(request.prompt_logprobs)
                   or offer.text_only_problem(request.logit_bias, request.ignore_eos))
    return problem


def _check_audio(request: Request, where: str, takes_wav: bool, media: Optional[frozenset[str]]) -> None:
    """`media`: the prompt media the plan takes (None: unknown, no plan given)."""
    if "audio" not in request.media or takes_wav:
        return
    if media is not None and "audio" not in media:  # (Llama's plan was told its audio input takes feature frames)
        raise WorkloadError(f"{where}: 'audio': this plan takes no audio prompt (its prompt media: "
                            f"{', '.join(sorted(media)) or 'none'})")
    raise WorkloadError(f"{where}: 'audio' is a WAV file of 16 kHz samples, and this plan's audio input takes "
                        "feature frames (a stand-in encoder), not samples; only plans whose audio encoder "
                        "takes a waveform (Whisper, Qwen3-ASR) read one")


def read_prompts(
    path: str, concurrency: Optional[int] = None, names: Optional[dict[str, list[str]]] = None,
    tokenizer: Any = None, form: Any = None, max_output_len: Optional[int] = None, takes_wav: bool = True,
    plan: Any = None, seed: int = 0,
) -> Workload:
    """Read a prompts file; with `names` (from `route_names`) each line's route is checked too;
    with `plan`, each line's guidance labels and loop counts (`plan_problem`);
    `tokenizer` turns text prompts into tokens (without one a text prompt is refused), framed by
    `form`, the plan's prompt format (serve/prompt_format.py `prompt_format_of`); max_output_len:
    the most output tokens the plan makes for a request (plan/output_bound.py), None when unstated;
    takes_wav: whether the plan's audio input takes 16 kHz samples (serve/audio_input.py
    `takes_waveform`): else a line's `audio` file is refused (each such request failed in the
    torch engine: its encoder takes feature frames); seed: a line without its own `seed` samples
    with seed x 1000003 + i, i its request's place in the file (as a generated workload's request
    i; with one seed for all, two lines of one prompt sampled the same tokens)."""
    counts, offer, starters = ((LoopCounts(plan), TextOffer(plan), starting_partitions(plan)) if plan is not None
                               else (None, None, set()))
    media = prompt_modalities(plan) - {"text"} if plan is not None else None
    named = shown_path(path)  # as messages name it
    if concurrency is not None and concurrency < 1:
        raise WorkloadError(f"--concurrency must be >= 1, got {shown(concurrency)}")
    try:
        data = read_bytes_bounded(path, max_bytes=MAX_PROMPTS_BYTES, what="prompts file")
        text = data.decode("utf-8-sig")  # -sig: a leading byte-order mark is skipped
    except InputFileError as error:
        raise WorkloadError(f"cannot read {error}") from None
    except UnicodeDecodeError as error:
        raise WorkloadError(
            f"cannot read prompts file {named}: not UTF-8 text (byte 0x{error.object[error.start]:02x} "
            f"at offset {error.start}); it must be JSON lines"
        ) from None
    # Line ends as Python's universal newlines read them (str.splitlines would also split on
    # U+2028 and other characters a JSON string may hold raw).
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    requests: list[Request] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{named}:{number}"
        request = parse_prompt_line(line, where, tokenizer, form, os.path.dirname(path) or ".")
        _check_audio(request, where, takes_wav, media)
        if names is not None:
            check_route(request.route, names, where, starters)
        problem = plan_problem(request, plan, counts, offer) if plan is not None else None
        if problem is not None:
            raise WorkloadError(f"{where}: {problem}")
        excess = excess_tokens_problem("'max_tokens'", request.max_tokens, max_output_len)
        if excess is not None:
            raise WorkloadError(f"{where}: {excess}")
        if request.id in seen:
            raise WorkloadError(f"{where}: duplicate id {request.id!r} (first on line {seen[request.id]})")
        seen[request.id] = number
        if request.seed is None:
            request.seed = seed * 1_000_003 + len(requests)
        requests.append(request)
    if not requests:
        raise WorkloadError(f"{named}: no requests in the file")
    return Workload(requests, closed_concurrency=concurrency)
