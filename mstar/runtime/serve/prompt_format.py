"""A plan's prompt format (spec `prompt_format`): a request's text and fields -> prompt tokens.

In: the `PromptFormatPlan` of the node that takes the text prompt, a `TextTokenizer`, the text
and the request's values for the template's other fields. Out: `before` + tokenizer.encode(the
filled template) + `after`, as the checkpoint's own code frames a prompt (Orpheus: start of
human, BOS, "tara: text", eot, end of human, start of AI, start of speech). A field the request
does not give takes the spec's default; a field with neither is refused (`PromptFormatError`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from mstar.plan.schema import PromptFormatPlan
from mstar.runtime.serve.tokenizer import unicode_problem


class PromptFormatError(Exception):
    """A request that the plan's prompt format cannot frame; the message says which field, and
    `field` names a format field at fault (None: the text, or the plan)."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


def prompt_format_of(plan: Any) -> Optional[PromptFormatPlan]:
    """The prompt format of the plan's text prompt node(s), or None when none declares one.
    Several text prompt nodes with different formats are refused: a request has one text."""
    formats = [node.prompt_format for node in plan.nodes if node.engine == "kv" and node.prompt_format is not None
               and any(i.prompt == "text" and i.role == "tokens" for i in node.input_roles)]
    if any(f != formats[0] for f in formats[1:]):
        raise PromptFormatError("the plan's text prompt nodes declare different prompt formats; "
                                "a request's text can be framed only one way")
    return formats[0] if formats else None


def format_prompt(form: PromptFormatPlan, tokenizer: Any, text: str, values: Mapping[str, Any]) -> list[int]:
    """The prompt tokens of `text` framed by `form`; `values`: the request's field values by name."""
    filled = {"prompt": _unicode(text, "the text")}
    for field in form.fields:
        value = values.get(field, form.defaults.get(field))
        if value is None:
            raise PromptFormatError(f"this model's prompt format needs '{field}' (its template is "
                                    f"{form.template!r}) and the request gives none", field)
        if not isinstance(value, str) or not value:
            raise PromptFormatError(f"'{field}' must be non-empty text", field)
        filled[field] = _unicode(value, f"'{field}'", field)
    return list(form.before) + tokenizer.encode(form.template.format(**filled)) + list(form.after)


def _unicode(value: str, what: str, field: Optional[str] = None) -> str:
    """`value` when it is valid Unicode, checked before the template frames it: the tokenizer's own
    check would count the position of a lone surrogate from the framed text (Orpheus's voice and
    colon before the prompt), not from what the client sent."""
    problem = unicode_problem(value)
    if problem is not None:
        raise PromptFormatError(f"{what} is not valid Unicode: {problem}", field)
    return value
