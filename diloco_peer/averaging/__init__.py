"""Averaging pseudo-gradients with a group of peers: one all-reduce per outer round.

Owns: the averager built on hivemind's ``DecentralizedAverager`` (``averager.py``: matchmaking, who may
join our groups, bans, serving our state), the butterfly all-reduce with exact results and byte counts
(``allreduce.py``), the wire codecs (``compression.py``) and the checks and robust aggregation every
received part goes through (``robust_aggregation.py``).
Imports: ``config``, ``training`` and ``swarm`` (admission); never ``state``, ``observe`` or above.
"""
