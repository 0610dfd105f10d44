"""What makes a request impossible on a kv node whatever its pool holds: a prompt token id outside
the spec's vocabulary (of a node that takes the text prompt), or prompt + max_tokens past the
node's max_seq_len. Shared by the torch engine's decoders (`DecoderRunner.refusal`) and the
simulated engine (`SimEngine.add_request`), so a what-if run refuses what a real one does. Where a
partition repeats, a prompt that alone fills one round's sequence (`round_prompt_problem`: the
simulated engine's and the Python API's check of what the torch engine's Whisper decoder refuses).

`EmptyPrompt`: an empty prompt on a route whose walks give a node the request's text prompt,
refused by both engines (a hand-built Request reached the model with no token to embed and ran on
a zero embedding), as the Python API and a prompts file refuse it before it is made.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from mstar.plan.stages import default_walks


def prompt_limit_problem(node: str, vocab: object, takes_text_prompt: bool, tokens: list[int],
                         max_tokens: Optional[int], max_seq_len: int) -> Optional[str]:
    """Why the request can never run on `node` (the message names the node), or None."""
    if isinstance(vocab, int) and vocab and takes_text_prompt:
        # The spec's vocabulary, not the (tiny) model's: a prompt written for the real model
        # still runs under --dims tiny, where ids are folded into the smaller vocabulary.
        problem = token_ids_problem(node, vocab, tokens)
        if problem is not None:
            return problem
    num_tokens = len(tokens) + (max_tokens or 0)
    if num_tokens > max_seq_len:
        return (f"node {node}: prompt ({len(tokens)}) + max_tokens ({max_tokens}) = {num_tokens} tokens "
                f"exceeds max_seq_len {max_seq_len}")
    return None


def round_prompt_problem(tokens: list[int], sequence_len: int) -> Optional[str]:
    """A prompt that fills a whole sequence (`sequence_len`: a node's max_seq_len, one round's), else
    None; the caller names the node where it has one. Each round of a repeating partition starts a
    new sequence holding the prompt, so a prompt + max_tokens within max_seq_len x rounds may still
    leave a round nothing to generate in (the torch engine's Whisper decoder refuses it; the
    simulated engine ran it, and the Python API passed it)."""
    if len(tokens) < sequence_len:
        return None
    return (f"the prompt ({len(tokens)} tokens) leaves none of a sequence's {sequence_len} positions to generate "
            f"in (each round starts a new sequence holding the prompt); give at most {sequence_len - 1} prompt "
            "tokens")


def token_ids_problem(node: str, vocab: int, tokens: list[int], vocabulary: str = "the vocabulary") -> Optional[str]:
    """A prompt token id outside [0, vocab) (`vocabulary` names which: the spec's, or the checkpoint's
    a node loaded, torch_engine.py), or None. min and max run in C; the offending id is looked for
    only when there is one (a generator over a 1,040-token prompt was 30 us of a cached request's
    admission)."""
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        bad = next(t for t in tokens if not 0 <= t < vocab)
        return f"node {node}: prompt token id {bad} is outside {vocabulary} [0, {vocab})"
    return None


def logit_bias_problem(node: str, vocab: object, takes_text_prompt: bool,
                       logit_bias: tuple[tuple[int, float], ...]) -> Optional[str]:
    """A logit_bias token id outside the spec's vocabulary of a node that takes the text prompt
    (the ids a bias names are the prompt's; `logit_bias` is sorted by id), or None."""
    if logit_bias and isinstance(vocab, int) and vocab and takes_text_prompt and logit_bias[-1][0] >= vocab:
        return f"logit_bias token id {logit_bias[-1][0]} is outside the vocabulary [0, {vocab}) of node {node}"
    return None


def takes_text_prompt(node: Any) -> bool:
    """Whether one of the node's inputs takes the request's text prompt (the plan's input roles):
    the nodes whose vocabulary `prompt_limit_problem` checks a prompt's ids against."""
    return any(role.prompt == "text" for role in node.input_roles)


def text_prompt_vocab(plan: Any) -> Optional[int]:
    """The smallest vocabulary of the nodes that take the text prompt (what `prompt_limit_problem`
    refuses ids past), None when none states one."""
    vocabs = [node.dims.get("vocab") for node in plan.nodes if takes_text_prompt(node)]
    known = [v for v in vocabs if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(known) if known else None


def stop_vocab(plan: Any) -> Optional[int]:
    """The largest vocabulary of the plan's kv nodes (a stop token id must be below it), None when
    none states one."""
    vocabs = [v for node in plan.nodes if node.engine == "kv"
              for v in [node.dims.get("vocab")] if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return max(vocabs) if vocabs else None


def stop_token_problem(vocab: Optional[int], stop_token_ids: Any, field: str) -> Optional[str]:
    """A stop token id no kv node of the plan can sample (`field`: the name the caller's input
    gives the list), else None."""
    bad = next((t for t in stop_token_ids if vocab is not None and t >= vocab), None)
    if bad is None:
        return None
    return f"{field} holds token id {bad}, outside the plan's vocabulary [0, {vocab})"


def starts_own_prompt(node: Any) -> bool:
    """Whether the node makes its own prompt when the request's is empty: a Whisper decoder begins
    its start sequence (runners/whisper_rules.py), so an empty prompt is a request it can run."""
    return node.dims.get("style") == "whisper"


class EmptyPrompt:
    """The plan's walks that give a node the request's text prompt (an input `tokens prompt text`
    of a node that does not make its own), read once: `problem` runs at every admission."""

    def __init__(self, plan: Any):
        own = {node.name for node in plan.nodes if starts_own_prompt(node)}
        # walk -> the first node it gives the text prompt to
        self.takers: dict[str, str] = {}
        for walk in plan.walks:
            node = next((call.node for call in walk.calls if call.node not in own
                         for source in call.inputs if source.source == "prompt" and source.prompt == "text"), None)
            if node is not None:
                self.takers[walk.name] = node
        self.defaults = {part.name: default_walks(part) for part in plan.partitions}

    def problem(self, request: Any) -> Optional[str]:
        """Why `request` (a Request, or its fields as a dict) cannot run for an empty prompt, or None:
        a request with media may leave the prompt empty (the Python API's rule: Whisper's decoder,
        a plan that lays out audio placeholders), and a route that gives no node the text prompt
        (V-JEPA 2's encoder-only walk) needs none."""
        get = request.get if isinstance(request, dict) else (lambda name: getattr(request, name, None))
        if get("prompt_tokens") or get("media") or not self.takers:
            return None
        route = get("route")
        route = route if isinstance(route, Mapping) else {}
        for part, walks in self.defaults.items():
            for walk in route.get(part, walks):
                node = self.takers.get(walk) if isinstance(walk, str) else None
                if node is not None:
                    return (f"the prompt is empty, but walk {walk} feeds the request's text prompt to node {node}: "
                            "give at least one prompt token")
        return None
