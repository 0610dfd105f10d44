"""Project-wide test settings.

Hypothesis profiles: `ci` (the default, used by .ci/run) keeps property runs short on a 2-core
machine; `long` runs many more examples: `HYPOTHESIS_PROFILE=long python3 -m pytest tests`.
"""
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
