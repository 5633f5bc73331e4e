"""Errors the planner raises for a request that cannot be satisfied (the API maps them to 422)."""


class PlanningError(ValueError):
    """The request is well-formed but names something impossible (unknown device, bad layout)."""


class InfeasibleError(PlanningError):
    """No layout in the search space fits; the message carries the numbers."""
