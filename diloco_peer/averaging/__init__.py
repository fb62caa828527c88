"""Averaging pseudo-gradients with a group of peers: one all-reduce per outer round.

Owns: one round's all-reduce as the daemon sees it (``averager.py``: ``RoundAverager``, ``RoundResult``), the
averager built on hivemind's ``DecentralizedAverager`` (``pseudo_gradient_averager.py``: matchmaking, serving
our state), who may join our groups (``membership.py``, ``group_bans.py``), the leader's assembly grace
(``assembly_grace.py``), the leader search's pace (``leader_search.py``), the butterfly all-reduce with exact
results and byte counts (``allreduce.py``), the members' questions to each other (``member_silence.py``,
``member_news.py``), the wire codecs (``compression.py``), the checks and robust aggregation every received part
goes through (``robust_aggregation.py``), and every use of hivemind's private averaging API
(``hivemind_internals.py``).
Imports: ``config``, ``lifecycle``, ``training`` and ``swarm`` (admission, p2pd internals); never ``state``,
``observe`` or above.
"""
