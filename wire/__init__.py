"""The v1 wire contract (docs/API.md): pydantic models of requests and plans, request -> planning problem and
result -> Plan conversion with the domain checks made once, and the one error shape.

Imports pydantic, `planner` (the problem it builds, the result it converts) and `cost_models` (presets);
never FastAPI, the store or `api`. Used by `api`, `adapters`, `render`, `executor`, the CLI and benchmarks.
"""
