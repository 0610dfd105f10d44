"""What a request must agree with in its plan, checked before it runs (serve/api.py `LLM.request`,
which the HTTP server calls too): prompt token ids inside the vocabulary of the nodes that take the
text prompt, stop token ids some kv node of the plan can sample, a route through the plan's
partitions and stages, guidance labels the plan declares, max_tokens within what the plan's walks
can make (plan/output_bound.py), log-probabilities (output or prompt), a logit bias and ignore_eos
only on a plan that acts on them (engine/text_offer.py), a hand-built Request's loop counts (the
conductor's own `LoopCounts`).

Each check reads the plan's own tables and the run loop's or engine's own rule, never a second copy:
the vocabulary check is `prompt_limit_problem` (engine/prompt_limits.py, what the torch and simulated
engines refuse at admission), the route check `mstar run --route`'s and a prompts file's
(workload.py `route_name_problem`: partition and walk names, every partition left out) and then
the conductor's `follow_stages`, the guidance labels the torch engine's own check
(plan/guidance_mode.py `unknown_label_problem`). Each returns a message, or None.
"""
from __future__ import annotations

from typing import Optional

from mstar.plan.guidance_mode import unknown_label_problem
from mstar.plan.output_bound import excess_tokens_problem, most_counted_tokens
from mstar.plan.schema import PartitionPlan, Plan
from mstar.runtime.conductor.conductor import RouteError, follow_stages
from mstar.runtime.conductor.loop_counts import LoopCounts
from mstar.runtime.engine.text_offer import TextOffer
from mstar.runtime.engine.prompt_limits import (
    logit_bias_problem, prompt_limit_problem, stop_token_problem, stop_vocab, takes_text_prompt,
)
from mstar.runtime.serve.workload import route_name_problem, route_names, starting_partitions


def stages_not_followed(partitions: dict[str, PartitionPlan],
                        route: dict[str, list[str]]) -> Optional[tuple[PartitionPlan, RouteError]]:
    """The first partition of `route` whose stages its walks do not follow, with the conductor's
    own refusal (`follow_stages`, what admission raises), or None. Every partition `route` names
    is in `partitions` (the callers check the names first: workload.py `route_name_problem`). The one
    stage rule of a request's route (`PlanChecks.route_problem`) and `mstar run --route`'s."""
    for name, walks in route.items():
        try:
            follow_stages(partitions[name], list(walks))
        except RouteError as error:
            return partitions[name], error
    return None


class PlanChecks:
    """A plan's tables a request is checked against (read once, when the LLM is built)."""

    def __init__(self, plan: Plan):
        # (node, the spec's vocabulary) of the kv nodes that take the text prompt: as the engines check
        self.prompt_vocabs = [(node.name, node.dims.get("vocab", 0)) for node in plan.nodes
                              if node.engine == "kv" and takes_text_prompt(node)]
        # the largest vocabulary of a kv node: a stop id at or past it is no token any node samples
        self.stop_vocab: Optional[int] = stop_vocab(plan)
        self.partitions = {part.name: part for part in plan.partitions}
        self.route_names = route_names(plan)  # {partition: the walks of its stages}
        self.starters = starting_partitions(plan)  # the partitions a request starts (not from streams)
        # what it does with text-token settings (a prompts file's lines ask the same, workload.py)
        self.text = TextOffer(plan)
        # the most counted tokens a request can get, from the walks' loops and stages; None: the
        # plan states no size for some counted output (plan/output_bound.py)
        self.most_tokens = most_counted_tokens(plan)
        self.loop_counts = LoopCounts(plan)  # a hand-built Request's loop_counts (the conductor's check)
        self.plan = plan

    def prompt_problem(self, ids: list[int]) -> Optional[str]:
        """A prompt token id outside a text prompt node's vocabulary (the engines' own check and
        message; max_seq_len is checked by the caller, against the plan's rounds)."""
        for node, vocab in self.prompt_vocabs:
            problem = prompt_limit_problem(node, vocab, True, ids, None, len(ids))
            if problem is not None:
                return problem
        return None

    def max_tokens_problem(self, max_tokens: int) -> Optional[str]:
        """max_tokens past what the plan's walks can make: the request would end at that count
        (finish_reason "length") without the tokens it asked for."""
        return excess_tokens_problem("max_tokens", max_tokens, self.most_tokens)

    def stop_problem(self, stop_token_ids: list[int]) -> Optional[str]:
        return stop_token_problem(self.stop_vocab, stop_token_ids, "stop_token_ids")

    def logit_bias_problem(self, pairs: list[tuple[int, float]]) -> Optional[str]:
        """A biased token id outside a text prompt node's vocabulary (the engines refused it at
        admission, a 400 that named no field and leaked the request's id). `pairs` sorted by id."""
        for node, vocab in self.prompt_vocabs:
            problem = logit_bias_problem(node, vocab, True, tuple(pairs))
            if problem is not None:
                return problem
        return None

    def route_problem(self, route: dict[str, list[str]]) -> Optional[str]:
        """The route's names and whether it leaves every partition out, in the words of `mstar
        run --route` and a prompts file's (workload.py `route_name_problem`), then its walks'
        order through the stages. The message starts with "route ", the field it is about."""
        problem = route_name_problem(route, self.route_names, self.starters)
        if problem is not None:
            return f"route is not one this plan takes: {problem}"
        unfollowed = stages_not_followed(self.partitions, route)
        if unfollowed is not None:
            part, error = unfollowed
            stages = [stage.walks for stage in part.stages]
            return f"route is not one this plan takes: {error} (the stages' walks: {stages})"
        return None

    def guidance_problem(self, guidance: dict[str, float]) -> Optional[str]:
        return unknown_label_problem(self.plan, guidance)
