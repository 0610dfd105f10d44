"""What log-probabilities a plan can give a request, and the refusal of those it cannot.

In: a `Plan`. Out: `LogprobOffer(plan)` with `logprobs_problem(n)` and
`prompt_logprobs_problem(n)`: None where the plan gives them (or none are asked), else the message
a request is refused with before it runs. Output log-probabilities are of the text tokens a call
sends the client (a plan whose calls send none, Orpheus's audio codes, has none); a prompt's are
given by the calls `models/kinds.py` `prompt_logprob_calls` names. Both the Python API
(`serve/plan_checks.py`) and a prompts file (`serve/workload.py` `plan_problem`) ask this, so a
request gets the same answer either way (a prompts file's `logprobs` came back `[]` on Orpheus
while its `prompt_logprobs` failed once the request ran).
"""
from __future__ import annotations

from typing import Any, Optional

from mstar.runtime.engine.models.kinds import call_table, prompt_logprob_calls


class LogprobOffer:
    def __init__(self, plan: Any):
        calls = call_table(plan)
        self.gives_logprobs = any(call.sends_text_tokens for call in calls.values())
        self.gives_prompt_logprobs = bool(prompt_logprob_calls(plan, calls))

    def logprobs_problem(self, logprobs: Optional[int]) -> Optional[str]:
        if logprobs is None or self.gives_logprobs:
            return None
        return ("logprobs asks for what this plan does not give: none of its walks sends text tokens to the client, "
                "so there are no output tokens to give log-probabilities of")

    def prompt_logprobs_problem(self, prompt_logprobs: Optional[int]) -> Optional[str]:
        if prompt_logprobs is None or self.gives_prompt_logprobs:
            return None
        return ("prompt_logprobs asks for what this plan does not give: none of its walks has a call outside "
                "loops that takes the text prompt and sends text tokens to the client")
