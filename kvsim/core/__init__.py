"""Core definitions shared by replay, live decoding and the simulator: head layouts and
scores, tiers, views, step logs and the attention arithmetic."""
