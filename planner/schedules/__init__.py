"""Pipeline schedules: per-stage operation orders, their simulation, and their choice.

A schedule is data: for every physical stage of one replica, the ordered
list of operations it runs (`F` forward, `B` full backward, or `I` input
gradient followed later by `W` weight gradient, as in zero-bubble
pipelining). The simulator turns an order plus operation times into a
timeline; the plan's iteration time comes from that timeline.
"""
