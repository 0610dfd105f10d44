"""The names a request's own fields take, which a prompt format's fields may not take.

A prompts line (`mstar run --prompts`) and the speech endpoint's body give a prompt format's fields
by name beside the request's own fields (its id, sampling settings, route, media...). A format
field named like one of those (`{seed}`) was read both ways: a prompts line's `"seed": "leo"` was
refused as a seed that is not a number, the same body with the field named otherwise ran. The
compiler refuses such a format field (MW140); the prompts line and the speech body read these.
"""
from __future__ import annotations

# the fields a prompts line may hold beside the plan's prompt format fields (`prompt` is the text
# the format's `{prompt}` takes)
LINE_FIELDS = frozenset({"id", "prompt_tokens", "prompt", "messages", "stop", "max_tokens", "temperature", "top_k",
                         "top_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_tokens",
                         "route", "guidance", "audio", "loop_counts", "logprobs", "prompt_logprobs",
                         "logit_bias", "ignore_eos", "min_tokens"})

# the speech endpoint's own fields beside the sampling ones above (`voice` and `instructions`, OpenAI's
# fields, are given to the format's fields of those names: they are its to take)
SPEECH_FIELDS = frozenset({"model", "input", "response_format", "speed", "stream_format", "stream"})

REQUEST_FIELDS = LINE_FIELDS | SPEECH_FIELDS
