"""Part of pass 5: the guidance mode and KV sequences of each capture (`guided` / `unguided`,
`labels=[...]`; capture_keys.py says what a step touches).

In:  a `Spec` node that passed resolve and check_graph, the walks that run each node (`runs`: walk ->
     node names), the run's `Diagnostics`.
Out: nothing; adds
- MW417: a capture's `labels` name something that is not a KV sequence (or cross_kv pool) of the
  node, or one twice; every label of a capture on a stateless node (it has no KV sequences).
- MW418: a `guided` capture on a node without `guidance` sequences: no step of it is ever guided,
  so the family would never replay.
- MW419: a capture's sequences are not those its steps touch: an `unguided` capture whose labels
  include a guidance sequence (an unguided request keeps only the others), labels that leave out
  or add a sequence the steps of its mode touch, or a capture without a mode on a walk whose
  guided steps touch other sequences than its unguided ones (one graph cannot serve both: write
  a `guided` line and an `unguided` one).
- MW425: two captures of one walk with the same key: one states a guidance mode and the other
  does not, and they are otherwise one family (MW414's rule), so a step of that mode could replay
  either with equal keys. (Two captures with the same mode are MW414's; with opposite modes they
  are apart.)
"""
from __future__ import annotations

from typing import Optional

from mstar.compiler import capture_keys, codes
from mstar.compiler.check_captures import is_one_family
from mstar.compiler.resolve import name_span, suggestion
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


def check_node(node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
    owned: list[tuple[ast.CaptureDecl, list[str]]] = [(c, [c.walk]) for c in node.captures if c.walk is not None]
    owned += [(c.capture, list(c.walks)) for c in node.combines if c.capture is not None]
    for capture, walks in owned:
        if not all(w in runs and node.name in runs[w] for w in walks):
            continue  # an unknown walk (MW103) or one that does not run the node (MW401)
        if not _labels_known(node, capture, diags):
            continue
        if capture.guidance == "guided" and not capture_keys.guidance_labels(node):
            diags.error(codes.CAPTURE_GUIDED_WITHOUT_GUIDANCE,
                        f"a `guided` capture on {node.name}, which has no `guidance` sequences: no step of it "
                        "is ever guided, so these graphs would never replay", _word_span(capture, "guided", diags))
            continue
        problem = _touch_problem(node, capture, walks)
        if problem is not None:
            diags.error(codes.CAPTURE_LABELS_MISMATCH, problem, capture.span)
    _check_same_key(node, diags)


def _labels_known(node: ast.NodeDecl, capture: ast.CaptureDecl, diags: Diagnostics) -> bool:
    """MW417 for each label that is not a KV sequence of the node, or is named twice."""
    known = capture_keys.sequences(node)
    is_ok = True
    for i, label in enumerate(capture.labels):
        span = _word_span(capture, label, diags)
        if not known:
            diags.error(codes.CAPTURE_LABEL_UNKNOWN,
                        f"capture label '{label}' on {node.name}, a stateless node: it has no KV sequences", span)
        elif label not in known:
            diags.error(codes.CAPTURE_LABEL_UNKNOWN,
                        f"'{label}' is not a KV sequence of {node.name} ({', '.join(known)})"
                        f"{suggestion(label, known)}", span,
                        *([Note("the KV sequences", node.kv_sequences.span)] if node.kv_sequences else []))
        elif label in capture.labels[:i]:
            diags.error(codes.CAPTURE_LABEL_UNKNOWN, f"capture labels name '{label}' twice", span)
        else:
            continue
        is_ok = False
    return is_ok


def _touch_problem(node: ast.NodeDecl, capture: ast.CaptureDecl, walks: list[str]) -> Optional[str]:
    """MW419's message, or None when the capture's sequences are those its steps touch."""
    what = " + ".join(walks)
    guided = capture_keys.touched(node, walks, is_guided=True)
    unguided = capture_keys.touched(node, walks, is_guided=False)
    if capture.guidance is None:
        if guided != unguided:
            return (f"steps of {what} on {node.name} in both guidance modes would replay this capture, but guided "
                    f"steps touch {_seqs(guided)} and unguided ones {_seqs(unguided)}: one graph cannot serve "
                    "both; write `guided` or `unguided` (a capture line for each mode)")
        expected = guided
    else:
        expected = guided if capture.guidance == "guided" else unguided
    if not capture.labels:
        return None
    written = capture_keys.family_labels(node, capture, walks)
    if written == expected:
        return None
    mode = f"{capture.guidance} " if capture.guidance is not None else ""
    dropped = [label for label in written if label in capture_keys.guidance_labels(node)]
    if capture.guidance == "unguided" and dropped:
        return (f"an unguided capture's labels include guidance sequence {dropped[0]}: an unguided request keeps "
                f"only {_seqs(unguided)} on {node.name}")
    return (f"labels {_seqs(written)} are not the KV sequences {mode}steps of {what} touch on {node.name} "
            f"({_seqs(expected)})")


def _seqs(labels: list[str]) -> str:
    return ", ".join(labels) if labels else "none"


def _check_same_key(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW425: a capture with a guidance mode and one without, of one walk and one family otherwise."""
    seen: dict[str, list[ast.CaptureDecl]] = {}
    for capture in node.captures:
        if capture.walk is None:
            continue
        earlier = next((c for c in seen.get(capture.walk, [])
                        if (c.guidance is None) != (capture.guidance is None) and is_one_family(c, capture,
                                                                                               is_mode_ignored=True)),
                       None)
        seen.setdefault(capture.walk, []).append(capture)
        if earlier is None:
            continue
        mode = capture.guidance or earlier.guidance
        diags.error(codes.CAPTURE_KEY_TWICE,
                    f"walk {capture.walk} has two captures on {node.name} with the same key: a {mode} step could "
                    "replay either, since one of them states no guidance mode (it serves both); state a mode on "
                    "both, or on neither and write one line",
                    capture.span, Note("the other", earlier.span))


def _word_span(capture: ast.CaptureDecl, word: str, diags: Diagnostics) -> ast.Span:
    """The span of `word` after the capture's walk name (the whole line when it is not found)."""
    skip = 1 if capture.walk == word else 0
    return name_span(capture.span, word, diags, skip=skip)
