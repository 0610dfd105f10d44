"""The benches' one-line refusal: a plan or flags a bench cannot run (`BenchError`, exit 1), and
the check every bench makes after its own run, that none of its requests failed (a refused request
runs no step, so the figures would measure nothing)."""
from __future__ import annotations

from mstar.runtime.serve.driver import Driver


class BenchError(ValueError):
    """The plan cannot be benched this way (the message says why)."""


def check_every_request_ran(driver: Driver, num_requests: int) -> None:
    """BenchError naming how many of the run's requests failed and the first one's reason."""
    failed = [r.finish_reason for r in driver.conductor.records.values() if (r.finish_reason or "").startswith("error")]
    if failed:
        raise BenchError(f"{len(failed)} of {num_requests} requests failed, the first with {failed[0]}")
