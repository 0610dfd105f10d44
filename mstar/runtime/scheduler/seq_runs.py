"""Arrival sequence numbers of one walk's FIFO rows, stored as runs of consecutive numbers.

Rows added together get consecutive sequence numbers, so a block of N rows costs one run, not N
integers: appending, dropping a prefix and finding a position are bisects over runs. Rows live at
"virtual positions" [base, end); a run starts at a virtual position and covers consecutive
positions and sequence numbers up to the next run's start. Removing rows from the middle
(removal, TP follow) rebuilds the runs; those paths are rare and touch rows one by one.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right


class SeqRuns:
    __slots__ = ("firsts", "starts", "base", "end")

    def __init__(self) -> None:
        self.firsts: list[int] = []  # sequence number of each run's first row (increasing)
        self.starts: list[int] = []  # virtual position of each run's first row (increasing)
        self.base = 0  # virtual position of the row at index 0
        self.end = 0  # one past the last row's virtual position

    def __len__(self) -> int:
        return self.end - self.base

    def append(self, first_seq: int, count: int) -> None:
        """Rows with sequence numbers first_seq .. first_seq + count - 1 join at the end."""
        if count <= 0:
            return
        firsts, starts = self.firsts, self.starts
        if firsts and firsts[-1] + (self.end - starts[-1]) == first_seq:
            self.end += count  # continues the last run
            return
        firsts.append(first_seq)
        starts.append(self.end)
        self.end += count

    def drop_front(self, count: int) -> None:
        """The first `count` rows leave."""
        self.base += count
        if self.base >= self.end:
            self.base = self.end
            self.firsts.clear()
            self.starts.clear()
            return
        spent = bisect_right(self.starts, self.base) - 1  # runs wholly before the new base
        if spent > 0:
            del self.firsts[:spent]
            del self.starts[:spent]

    def seq_at(self, index: int) -> int:
        """Sequence number of the row at `index` (0 = the oldest)."""
        position = self.base + index
        run = bisect_right(self.starts, position) - 1
        return self.firsts[run] + position - self.starts[run]

    def index_at_or_after(self, seq: int, start: int) -> int:
        """Index of the first row at or after index `start` whose sequence number is >= seq
        (len(self) when there is none)."""
        runs_before = bisect_left(self.firsts, seq)
        if runs_before == 0:
            return start
        run = runs_before - 1
        run_end = self.starts[runs_before] if runs_before < len(self.starts) else self.end
        position = self.starts[run] + min(seq - self.firsts[run], run_end - self.starts[run])
        return max(position - self.base, start)

    def to_list(self) -> list[int]:
        """Every row's sequence number, oldest first (rare paths only)."""
        return [self.seq_at(index) for index in range(len(self))]

    def reset(self, seqs: list[int]) -> None:
        """Replace the rows by these sequence numbers (increasing)."""
        self.firsts.clear()
        self.starts.clear()
        self.base = self.end = 0
        for seq in seqs:
            self.append(seq, 1)
