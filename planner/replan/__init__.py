"""Replanning a running job: keep or move, placed on the devices that hold the state, migration priced."""
