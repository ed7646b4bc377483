"""Shared test configuration: Hypothesis profiles and the SPMD pools of real gloo ranks.

Profiles: ``default`` is derandomised (the same examples on every run, so CI is reproducible);
``long`` (``HYPOTHESIS_PROFILE=long``, ``nox -s tests_long``) draws many more random examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    derandomize=True,
    deadline=None,
    max_examples=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    derandomize=False,
    deadline=None,
    max_examples=500,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
