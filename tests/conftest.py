"""Shared test configuration: Hypothesis profiles and the SPMD pools of real gloo ranks.

Profiles: ``default`` is derandomised (the same examples on every run, so CI is reproducible);
``long`` (``HYPOTHESIS_PROFILE=long``, ``nox -s tests_long``) draws many more random examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "print_blob": True, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", derandomize=True, max_examples=40, **_COMMON)
settings.register_profile("long", derandomize=False, max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
