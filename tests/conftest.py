"""Hypothesis runs without its per-example deadline: CI machines are shared and noisy, and a
slow example says nothing about correctness (speed is measured by bench/, side by side)."""

from hypothesis import HealthCheck, settings

settings.register_profile("noisy-machine", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("noisy-machine")
