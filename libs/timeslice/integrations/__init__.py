"""Adapters that wire time-slicing into the RL frameworks people run, without changing their code.

- :mod:`timeslice.integrations.slime`: Slime's phase callback (the llm-d reference's contract).
- :mod:`timeslice.integrations.trl`: TRL's ``GRPOTrainer``, one group for both phases.
- :mod:`timeslice.integrations.verl`: veRL's V1 ``sync`` trainer, registered as a trainer mode.

None of them imports its framework until it is used.
"""
