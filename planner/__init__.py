"""The optimization core: candidate generation, CP-SAT models, plan assembly.

Never imports FastAPI: the service, the CLI and tests call `plan_uniform`
with a `PlanningProblem` built from the request.
"""
