"""The uniform search: every replica the same shape; branch and bound over shapes, CP-SAT layer splits."""
