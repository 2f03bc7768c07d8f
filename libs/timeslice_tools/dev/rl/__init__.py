"""Real RL training through time-slicing: two TRL GRPO jobs, compared bit for bit with their
runs alone (``make demo-rl``; needs ``trl``, installed with ``.[dev]``)."""
