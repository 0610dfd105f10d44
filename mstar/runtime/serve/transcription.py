"""A `/v1/audio/transcriptions` request: the multipart form read and checked, its WAV decoded, the
decoder's start sequence for a chosen language.

In: the HTTP request (OpenAI's multipart form: `file`, `model`, `language`, `prompt`,
`response_format`, `temperature`, `stream`; extensions `max_tokens`, `seed`), the plan's audio
input (serve/audio_input.py) and the tokenizer. Out: `read_form(http) -> TranscriptionForm`,
`samples(form, audio_input)` (a 1-D float tensor at the plan's rate), `start_sequence(plan,
tokenizer, language)` (token ids), or an `ApiError`: 400 for a missing or bad field, a file that is
not a WAV the plan's front end can take (another sample rate is refused, never resampled), audio
longer than the front end's window or empty; 413 for a body past MAX_AUDIO_BYTES (plus room for
the other fields), counted as it arrives, so an upload without a length is cut off too.

Options the server cannot honour are refused, not ignored: `prompt` (previous-text context),
`timestamp_granularities`, `include`, `chunking_strategy`, and response formats other than json
and text (verbose_json, srt and vtt need timestamps, which this server does not decode).

The start sequence: an absent `language` gives an empty prompt, so the decoder detects it (as
`mstar run` does for a prompts line with only `audio`); a language gives Whisper's
`<|startoftranscript|><|LANG|><|transcribe|><|notimestamps|>`, which transformers' generate builds
for `language=LANG`, read from the tokenizer's vocabulary. Only a plan whose text prompt node is a
Whisper decoder (its `style` argument, never its name) takes a language that way; a plan whose
prompt holds audio placeholders (a `media_token`: Qwen3-ASR) takes it as the text that prefills
the answer, `language NAME<asr_text>`, for the model's 30 languages.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import Request as HttpRequest
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mstar.arg_types import shown
from mstar.files import MAX_AUDIO_BYTES
from mstar.plan.schema import Plan
from mstar.runtime.serve.audio_input import AudioInput
from mstar.runtime.serve.http_schema import ApiError
from mstar.runtime.serve.upload_cut import UploadCutError

FORM_SLACK = 1 << 20  # the form's other fields and part headers, beside the file
MAX_FORM_FIELDS = 32
RESPONSE_FORMATS = ("json", "text")
UNSUPPORTED = {"timestamp_granularities": "timestamps are not decoded", "include": "logprobs are not returned",
               "chunking_strategy": "the audio is one window of the plan's front end"}
LANGUAGE = re.compile(r"[a-z]{2,3}")  # Whisper's language tokens: ISO 639-1 codes, a few of three letters
WHISPER_START = ("<|startoftranscript|>", "<|{language}|>", "<|transcribe|>", "<|notimestamps|>")
# Qwen3-ASR's forced languages: the names it was trained with after "language " (transformers'
# processing_qwen3_asr.LANGUAGE_CODE_TO_NAME)
LANGUAGE_NAMES = {
    "ar": "Arabic", "yue": "Cantonese", "zh": "Chinese", "cs": "Czech", "da": "Danish", "nl": "Dutch",
    "en": "English", "fil": "Filipino", "fi": "Finnish", "fr": "French", "de": "German", "el": "Greek",
    "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "mk": "Macedonian", "ms": "Malay", "fa": "Persian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "es": "Spanish", "sv": "Swedish", "th": "Thai", "tr": "Turkish", "vi": "Vietnamese",
}


@dataclass
class TranscriptionForm:
    model: str
    data: bytes  # the uploaded file
    filename: str
    language: Optional[str] = None
    response_format: str = "json"
    temperature: Optional[float] = None
    is_stream: bool = False
    max_tokens: Optional[int] = None
    seed: Optional[int] = None


async def read_form(http: HttpRequest) -> TranscriptionForm:
    limit = MAX_AUDIO_BYTES + FORM_SLACK
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    bounded = HttpRequest(http.scope, _bounded_receive(http, limit))
    try:
        async with bounded.form(max_files=1, max_fields=MAX_FORM_FIELDS) as form:
            fields = {key: value for key, value in form.multi_items() if isinstance(value, str)}
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "file: a WAV file is required (a multipart form field `file` holding the audio)",
                               param="file")
            data = await upload.read(MAX_AUDIO_BYTES + 1)
            if len(data) > MAX_AUDIO_BYTES:
                raise _too_large(limit)
            filename = upload.filename or "file"
    except UploadCutError:  # the drain cut the upload: its 503 as it is
        raise
    except StarletteHTTPException as error:  # a body starlette cannot parse as a form: answered and counted as ours
        raise ApiError(error.status_code, f"the body is not a form this endpoint reads: {error.detail}") from None
    except ClientDisconnect:  # (uncaught, the server logged a traceback for a client's abort; not a bad request)
        raise ApiError(400, "the client disconnected before its upload ended", is_counted=True) from None
    return _checked(fields, data, filename)


def _bounded_receive(http: HttpRequest, limit: int) -> Any:
    received = 0

    async def receive() -> Any:
        nonlocal received
        message = await http.receive()
        if message.get("type") == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise _too_large(limit)
        return message

    return receive


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request is larger than {limit} bytes: an audio file may have at most "
                         f"{MAX_AUDIO_BYTES} bytes", param="file")


def _checked(fields: dict[str, str], data: bytes, filename: str) -> TranscriptionForm:
    model = fields.get("model")
    if not model:
        raise ApiError(400, "model: a model name is required", param="model")
    for name, why in UNSUPPORTED.items():
        if any(key == name or key.startswith(f"{name}[") for key in fields):
            raise ApiError(400, f"{name} is not supported ({why})", param=name)
    if fields.get("prompt"):
        raise ApiError(400, "prompt (text that conditions the transcript) is not supported", param="prompt")
    response_format = fields.get("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format {shown(response_format)} is not supported: json or text (verbose_json, "
                            "srt and vtt need timestamps, which this server does not decode)",
                       param="response_format")
    language = (fields.get("language") or "").strip().lower() or None
    if language is not None and not LANGUAGE.fullmatch(language):
        raise ApiError(400, f"language must be an ISO 639-1 code such as 'en', got {shown(fields['language'])}",
                       param="language")
    return TranscriptionForm(model, data, filename, language, response_format,
                             _number(fields, "temperature", float), _flag(fields, "stream"),
                             _number(fields, "max_tokens", int), _number(fields, "seed", int))


# A form field's number as the JSON endpoints take one: ASCII digits only (Python's int() and
# float() also read other scripts' digits, "٥", and float() "nan" and "inf").
NUMBER_FORMS = {int: re.compile(r"[+-]?[0-9]+"),
                float: re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")}


def _number(fields: dict[str, str], name: str, kind: type) -> Any:
    """The field's number, None when absent. Values are echoed clipped (`shown`): a 100,000-character
    field came back whole in the 400."""
    text = fields.get(name, "").strip()
    if not text:
        return None
    if not NUMBER_FORMS[kind].fullmatch(text):
        raise ApiError(400, f"{name} must be {'a number' if kind is float else 'an integer'}, got {shown(text)}",
                       param=name)
    try:
        return kind(text)
    except ValueError:  # int() past Python's 4,300-digit limit (it was a 500, "internal error (ValueError ...)")
        raise ApiError(400, f"{name} is out of range (too many digits), got {shown(text)}", param=name) from None


def _flag(fields: dict[str, str], name: str) -> bool:
    text = fields.get(name, "").strip().lower()
    if text in ("", "false", "0"):
        return False
    if text in ("true", "1"):
        return True
    raise ApiError(400, f"{name} must be true or false, got {shown(fields[name])}", param=name)


def samples(form: TranscriptionForm, audio: AudioInput) -> Any:
    """The file's samples at the plan's rate (400 for a bad, empty or too long one)."""
    from mstar.runtime.serve.wav import WavError, WavTooLong, decode_wav

    try:
        decoded = decode_wav(form.data, f"file {form.filename!r}", audio.sample_rate, audio.max_samples)
    except WavTooLong as error:  # (from the header: a refused file is not decoded first)
        raise _too_long(form, audio, error.num_samples) from None
    except WavError as error:
        raise ApiError(400, str(error), param="file") from None
    if int(decoded.shape[0]) == 0:
        raise ApiError(400, f"file {form.filename!r}: the WAV file holds no samples", param="file")
    return decoded


def _too_long(form: TranscriptionForm, audio: AudioInput, num_samples: int) -> ApiError:
    seconds = f"{num_samples / audio.sample_rate:.2f}"
    if float(seconds) <= audio.max_seconds:  # (480,001 samples read "30.00 s", as if within 30 s)
        seconds = f"{num_samples / audio.sample_rate:.6f}"
    return ApiError(400, f"file {form.filename!r}: {seconds} s of audio; this "
                         f"model transcribes at most {audio.max_seconds:g} s"
                         + (" (one window of its front end)" if audio.max_samples == audio.window_samples
                            else f" ({audio.max_samples // audio.window_samples} windows of its front end)"),
                    param="file")


def start_sequence(plan: Plan, tokenizer: Any, language: Optional[str]) -> Union[list[int], str]:
    """The decoder prompt: [] (the language detected), or for `language` Whisper's start sequence,
    or, on a plan whose prompt holds audio placeholders (Qwen3-ASR), the text that prefills the
    answer with that language (`language English<asr_text>`, as transformers'
    apply_transcription_request forces one)."""
    if language is None:
        return []
    from mstar.runtime.serve.audio_prompt import audio_layout_of

    if audio_layout_of(plan) is not None:
        name = LANGUAGE_NAMES.get(language)
        if name is None:
            raise ApiError(400, f"language {language!r} is not one of this model's languages "
                                f"({', '.join(sorted(LANGUAGE_NAMES))})", param="language")
        return f"language {name}<asr_text>"
    decoders = [n for n in plan.nodes if n.engine == "kv" and any(i.prompt == "text" for i in n.input_roles)]
    if not decoders or any(n.dims.get("style") != "whisper" for n in decoders):
        raise ApiError(400, "language: this model's decoder takes no language token", param="language")
    if tokenizer is None:
        raise ApiError(400, "language: choosing one needs the model's tokenizer, and this server has none",
                       param="language")
    tokens = [name.format(language=language) for name in WHISPER_START]
    ids = [tokenizer.token_id(token) for token in tokens]
    if ids[1] is None:
        raise ApiError(400, f"language {language!r} is not one of this model's languages (no token {tokens[1]})",
                       param="language")
    missing = [token for token, found in zip(tokens, ids) if found is None]
    if missing:
        raise ApiError(400, f"language: the tokenizer has no {missing[0]} token to start a transcript with",
                       param="language")
    return [int(i) for i in ids if i is not None]
