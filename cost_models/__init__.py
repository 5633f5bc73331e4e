"""Pure cost functions for transformer training: FLOPs, time, communication, memory.

Nothing here imports the planner or the service; every function is pure and
takes frozen dataclasses or plain numbers, with units in the names.
"""
