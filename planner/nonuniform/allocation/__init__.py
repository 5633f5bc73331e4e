"""How many replicas of each template and how many microbatches each: CP-SAT feasibility probes over
pipeline budgets, ordered by an LP relaxation."""
