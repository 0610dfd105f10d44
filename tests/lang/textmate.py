"""A small TextMate tokenizer, enough to run editors/mw.tmLanguage.json in the tests.

In: a grammar (the JSON as a dict) and lines of text. Out: per line, the scope stack of every
character (outermost first, the grammar's scopeName at the bottom).

What it implements of TextMate's rules: `match` with `name` and `captures`, `begin`/`end` with
`name`, `beginCaptures`/`endCaptures` (or `captures`) and nested `patterns`, `include` of
`#repository` entries and `$self`, and a `patterns` list as a rule. At each position the rule
whose regex matches earliest wins, ties going to the first in order, with a begin/end rule's `end`
tried before its patterns (vscode-textmate's order without `applyEndPatternLast`). Regexes are
compiled with Python's `re`: the grammar keeps to the syntax that Oniguruma (what editors run) and
`re` read alike (no possessive quantifiers, no \\h, \\G or \\A), which `compile_all` checks by
compiling every pattern.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass
class _Open:
    """A begin/end rule that is open: its end regex and the scopes it pushed."""

    rule: dict
    end: re.Pattern
    scopes: list[str]


class Tokenizer:
    def __init__(self, grammar: dict[str, Any]):
        self.grammar = grammar
        self.repository = grammar.get("repository", {})
        self._compiled: dict[str, re.Pattern] = {}

    def regex(self, source: str) -> re.Pattern:
        if source not in self._compiled:
            self._compiled[source] = re.compile(source)
        return self._compiled[source]

    def compile_all(self) -> int:
        """Compile every regex of the grammar (raises re.error); returns how many there are."""
        sources = []

        def walk(rule: Any) -> None:
            if isinstance(rule, dict):
                sources.extend(rule[key] for key in ("match", "begin", "end") if key in rule)
                for value in rule.values():
                    walk(value)
            elif isinstance(rule, list):
                for item in rule:
                    walk(item)

        walk(self.grammar)
        for source in sources:
            self.regex(source)
        return len(sources)

    def _flatten(self, patterns: list[dict], seen: frozenset = frozenset()) -> list[dict]:
        """Rules with a regex, in order, includes expanded."""
        out: list[dict] = []
        for rule in patterns:
            if "include" in rule:
                name = rule["include"]
                if name in seen:
                    continue
                target = self.grammar if name == "$self" else self.repository[name[1:]]
                out += self._flatten(target.get("patterns", []) if "match" not in target and "begin" not in target
                                     else [target], seen | {name})
            elif "match" in rule or "begin" in rule:
                out.append(rule)
            elif "patterns" in rule:
                out += self._flatten(rule["patterns"], seen)
        return out

    @staticmethod
    def _paint(scopes: list[list[str]], match: re.Match, base: list[str], name: str | None,
               captures: dict[str, dict]) -> None:
        outer = base + ([name] if name else [])
        for i in range(match.start(), match.end()):
            scopes[i] = list(outer)
        for group, capture in sorted(captures.items(), key=lambda item: int(item[0])):
            start, end = match.span(int(group))
            if start < 0 or "name" not in capture:
                continue
            for i in range(start, end):
                scopes[i] = scopes[i] + [capture["name"]]

    def tokenize(self, lines: list[str]) -> list[list[list[str]]]:
        """The scope stack of every character of every line."""
        root = [self.grammar["scopeName"]]
        stack: list[_Open] = []
        result = []
        for line in lines:
            scopes = [list(root) for _ in line]
            pos = 0
            while pos <= len(line):
                base = stack[-1].scopes if stack else root
                rules = self._flatten(stack[-1].rule.get("patterns", []) if stack else self.grammar["patterns"])
                best: tuple[int, int, Any, re.Match] | None = None
                if stack:
                    end = stack[-1].end.search(line, pos)
                    if end:
                        best = (end.start(), -1, None, end)
                for order, rule in enumerate(rules):
                    found = self.regex(rule.get("match", rule.get("begin"))).search(line, pos)
                    if found and (best is None or (found.start(), order) < best[:2]):
                        best = (found.start(), order, rule, found)
                if best is None:
                    for i in range(pos, len(line)):
                        scopes[i] = list(base)
                    break
                _, _, rule, found = best
                for i in range(pos, found.start()):  # the gap before the match: the open rule's scope
                    scopes[i] = list(base)
                if rule is None:  # the open rule ends
                    closing = stack.pop()
                    self._paint(scopes, found, closing.scopes[:-1] if closing.rule.get("name") else closing.scopes,
                                closing.rule.get("name"),
                                closing.rule.get("endCaptures", closing.rule.get("captures", {})))
                elif "match" in rule:
                    self._paint(scopes, found, base, rule.get("name"), rule.get("captures", {}))
                else:
                    self._paint(scopes, found, base, rule.get("name"),
                                rule.get("beginCaptures", rule.get("captures", {})))
                    pushed = base + ([rule["name"]] if rule.get("name") else [])
                    stack.append(_Open(rule, self.regex(rule["end"]), pushed))
                if found.end() == pos and (rule is None or "match" in rule):
                    pos += 1  # an empty match: step on, or loop forever
                else:
                    pos = found.end()
            result.append(scopes)
        return result
