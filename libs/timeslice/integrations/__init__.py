"""Adapters that wire time-slicing into the RL frameworks people run, without changing their code.

- :mod:`timeslice.integrations.slime`: Slime's phase callback (the llm-d reference's contract).
"""
