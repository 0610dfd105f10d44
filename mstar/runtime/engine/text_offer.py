"""What a plan does with a request's settings about text tokens, and the refusal of those it
would ignore.

In: a `Plan`. Out: `TextOffer(plan)` with `logprobs_problem(n)`, `prompt_logprobs_problem(n)` and
`text_only_problem(logit_bias, ignore_eos)`: None where the plan honours them (or none are asked),
else the message a request is refused with before it runs. Output log-probabilities, a logit bias
and ignore_eos act on the tokens a call sends the client as text (`CallInfo.sends_text_tokens`; a
plan whose calls send none, Orpheus's audio codes, has none); a prompt's log-probabilities are
given by the calls `models/kinds.py` `prompt_logprob_calls` names. Both the Python API
(`serve/plan_checks.py`) and a prompts file (`serve/workload.py` `plan_problem`) ask this, so a
request gets the same answer either way (on Orpheus a prompts file's `logprobs` came back `[]`
while its `prompt_logprobs` failed once the request ran; `logit_bias` and `ignore_eos` were taken
and did nothing, in both).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mstar.runtime.engine.models.kinds import call_table, prompt_logprob_calls

# (Whisper's plan sends the client a transcript, text: "sends no text tokens" read as false there)
NO_TEXT = ("none of its walks sends the client its sampled tokens as text, one by one (a transcript's tokens, "
           "sent once final, are not)")


class TextOffer:
    def __init__(self, plan: Any):
        calls = call_table(plan)
        self.sends_text = any(call.sends_text_tokens for call in calls.values())
        self.gives_prompt_logprobs = bool(prompt_logprob_calls(plan, calls))

    def logprobs_problem(self, logprobs: Optional[int]) -> Optional[str]:
        if logprobs is None or self.sends_text:
            return None
        return f"logprobs asks for what this plan does not give: {NO_TEXT}, so there are no output tokens to give " \
               "log-probabilities of"

    def prompt_logprobs_problem(self, prompt_logprobs: Optional[int]) -> Optional[str]:
        if prompt_logprobs is None or self.gives_prompt_logprobs:
            return None
        return ("prompt_logprobs asks for what this plan does not give: none of its walks has a call outside "
                "loops that takes the text prompt and sends text tokens to the client")

    def text_only_problem(self, logit_bias: Sequence[Any], ignore_eos: bool) -> Optional[str]:
        """A logit bias or ignore_eos on a plan that sends no text tokens: both act on those calls'
        tokens only, so the request would run as if it had not asked."""
        if self.sends_text:
            return None
        if logit_bias:
            return f"logit_bias would change nothing on this plan: {NO_TEXT}, and a bias applies to those tokens only"
        if ignore_eos:
            return f"ignore_eos would change nothing on this plan: {NO_TEXT}, and it applies to those calls only"
        return None
