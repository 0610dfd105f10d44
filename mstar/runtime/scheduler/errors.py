"""Errors raised by the scheduler; each message names the row, request or key concerned."""


class SchedulerError(Exception):
    """A misuse of the scheduler or a broken invariant."""


class LostRowError(SchedulerError):
    """The batch builder failed to hand back a row it was given (scheduled, backlog or returned)."""


class UnknownPlacementError(SchedulerError):
    """A row names a (node, walk) this worker does not run, or a batch names an unknown key."""


class DuplicateRowError(SchedulerError):
    """A row was added while the same request already has a ready or held row under that key."""
