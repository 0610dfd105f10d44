"""Ready rows of one scheduling key, kept columnar: per walk, parallel FIFO lists.

For walk index w: `ids[w]` (request ids), `runs[w]` (their arrival sequence numbers, strictly
increasing within and across walks so merged FIFO order is by sequence, kept as runs: see
seq_runs.py) and `tokens[w]`. Rows enter
in blocks and leave as prefixes of each walk's lists, so the cost per step is a few C-level list
operations whatever the number of rows. `present` holds every request with a ready or held row
under the key; it catches duplicates and lost rows.
"""
from __future__ import annotations

from typing import Sequence

from mstar.runtime.scheduler.errors import DuplicateRowError, LostRowError
from mstar.runtime.scheduler.seq_runs import SeqRuns


class KeyQueue:
    """FIFO ready rows of one key, per walk; plus the ids of this key's held rows."""

    def __init__(self, name: str, walks: list[str]) -> None:
        self.name = name
        self.walks = walks
        num_walks = len(walks)
        self.ids: list[list[str]] = [[] for _ in range(num_walks)]
        self.runs: list[SeqRuns] = [SeqRuns() for _ in range(num_walks)]
        self.tokens: list[list[int]] = [[] for _ in range(num_walks)]
        self.present: set[str] = set()
        self.held: set[str] = set()
        self.num_ready = 0
        # request id -> tokens of its KV before its next chunk, for rows of cut walks on a key
        # whose budget counts context (token_budget.py); absent = 0
        self.contexts: dict[str, int] = {}

    def num_ready_walk(self, walk: int) -> int:
        return len(self.ids[walk])

    def add(self, walk: int, request_ids: Sequence[str], first_seq: int, tokens: list[int], is_new: bool) -> None:
        """Append rows of one walk in order with seqs first_seq, first_seq+1, ...

        is_new: the rows enter the key now (checked against `present`); False for rows coming
        back from a hold, which stayed present while held.
        """
        count = len(request_ids)
        if is_new:
            present = self.present
            if not present.isdisjoint(request_ids):
                dup = next(rid for rid in request_ids if rid in present)
                raise DuplicateRowError(
                    f"request {dup!r} already has a ready or held row under key {self.name}"
                )
            num_before = len(present)
            present.update(request_ids)
            if len(present) - num_before != count:
                present.difference_update(request_ids)  # all were new: undo exactly this add
                raise DuplicateRowError(f"a request id repeats among rows added under key {self.name}")
        self.ids[walk].extend(request_ids)
        self.runs[walk].append(first_seq, count)
        self.tokens[walk].extend(tokens)
        self.num_ready += count

    def take(self, takes: list[int]) -> list[tuple[int, list[str], list[int]]]:
        """Remove the first takes[w] rows of each walk; return (walk, ids, tokens) for each walk
        that gives rows, in walk order.

        Raises LostRowError if the rows handed out plus the rows left differ from the rows held
        before (every row given to the builder comes back: scheduled or still ready).
        """
        parts: list[tuple[int, list[str], list[int]]] = []
        num_taken = 0
        for w, count in enumerate(takes):
            if count:
                ids, tokens = self.ids[w], self.tokens[w]
                chosen = ids[:count]
                parts.append((w, chosen, tokens[:count]))
                del ids[:count]
                self.runs[w].drop_front(count)
                del tokens[:count]
                self.present.difference_update(chosen)
                num_taken += count
        self.num_ready -= num_taken
        self.check_accounting()
        return parts

    def take_rows(self, walk: int, request_ids: Sequence[str]) -> list[int]:
        """Remove the named rows of one walk (any positions); return their tokens in the order
        named. Every named row must be ready (callers check with `has_rows` first)."""
        wanted = set(request_ids)
        ids, tokens = self.ids[walk], self.tokens[walk]
        seqs = self.runs[walk].to_list()
        token_of: dict[str, int] = {}
        kept: list[int] = []
        for i, rid in enumerate(ids):
            if rid in wanted:
                token_of[rid] = tokens[i]
            else:
                kept.append(i)
        self.ids[walk] = [ids[i] for i in kept]
        self.runs[walk].reset([seqs[i] for i in kept])
        self.tokens[walk] = [tokens[i] for i in kept]
        self.present.difference_update(wanted)
        self.num_ready -= len(ids) - len(kept)
        self.check_accounting()
        return [token_of[rid] for rid in request_ids]

    def has_rows(self, walk: int, request_ids: Sequence[str]) -> bool:
        """Whether every named request has a ready row of this walk."""
        return set(self.ids[walk]).issuperset(request_ids)

    def drop_request(self, request_id: str) -> bool:
        """Remove the request's ready row (if any); True when one was removed."""
        for w, ids in enumerate(self.ids):
            if request_id in ids:
                at = ids.index(request_id)
                del ids[at]
                runs = self.runs[w]
                seqs = runs.to_list()
                del seqs[at]
                runs.reset(seqs)
                del self.tokens[w][at]
                self.present.discard(request_id)
                self.num_ready -= 1
                return True
        return False

    def check_accounting(self) -> None:
        """Every present request is ready or held here; raise LostRowError naming one that is not."""
        num_listed = sum(map(len, self.ids))
        if num_listed == self.num_ready and len(self.present) == num_listed + len(self.held):
            return
        ready = {rid for ids in self.ids for rid in ids}
        lost = sorted(self.present - ready - self.held)
        raise LostRowError(
            f"key {self.name}: row(s) of request(s) {lost[:5]} were handed to the builder and not "
            f"handed back ({len(self.present)} present, {num_listed} listed ready of {self.num_ready} counted, "
            f"{len(self.held)} held)"
        )
