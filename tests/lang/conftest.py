"""Hypothesis profiles for the language tests.

`ci` (the default: moderate example counts, so tests/lang finishes in well under a minute) and
`long` (many more examples): `HYPOTHESIS_PROFILE=long python3 -m pytest tests/lang`. The project's
tests/conftest.py registers and loads the same two profiles; they are registered here only when it
has not, so that tests/lang also runs alone from another root.
"""
import os

from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

_PROFILES = {"ci": 60, "long": 2000}

for _name, _num_examples in _PROFILES.items():
    try:
        settings.get_profile(_name)
    except InvalidArgument:
        settings.register_profile(_name, max_examples=_num_examples, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("HYPOTHESIS_PROFILE", "ci") in _PROFILES:
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
