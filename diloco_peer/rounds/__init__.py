"""Outer rounds: train, exchange, conclude, heal; round after round, in the mode the swarm runs.

Owns: the round's loop (``outer_rounds.py``), its schedules (``schedule.py``: blocking, and overlapped with an
eager or delayed correction), its exchange (``exchange.py``: the gate and the all-reduce), the decision of its
outcome (``outcome.py``, pure), the average applied mid-round as it arrives (``arrival.py``), healing by state
sync (``healing.py``), the pace of rounds bounded by time (``pace.py``: the round's period, the steps it holds)
and what a round produces (``record.py``).
Imports: anything below (``config``, ``lifecycle``, ``training``, ``swarm``, ``averaging``, ``state``,
``observe``); nothing above (``tools``, the daemon).
"""
