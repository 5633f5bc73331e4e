"""Deterministic hypothesis profile; shared fixtures."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "resiplan", derandomize=True, deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("resiplan")
