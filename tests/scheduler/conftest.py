"""Scheduler tests: hypothesis profiles.

The project-wide tests/conftest.py registers `ci` (default, short) and `long`; this file adds
`sched-long` for long scheduler-only runs (`HYPOTHESIS_PROFILE=sched-long python3 -m pytest
tests/scheduler`): many more examples and longer traces' shrinking budget.
"""
from hypothesis import HealthCheck, settings

settings.register_profile(
    "sched-long", max_examples=5000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
