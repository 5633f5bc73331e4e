"""Plans for people: the Gantt chart and cluster map SVGs, the plan page and the terminal table.

Imports `wire` (the Plan) only, never `api`; every plan-derived string is escaped for its context
(`render.markup`).
"""
