"""What a peer and a swarm show of themselves: events, metrics, the swarm monitor, reports.

Owns: the JSON-lines event log every peer writes (``events.py``), the Prometheus metrics and health
endpoint fed by it (``metrics.py``), the swarm-wide view a bootstrap node exports from the DHT's records
(``monitor.py``) and the summary tables and plots of a run's event logs (``report.py``).
Imports: anything below (``config``, ``lifecycle``, ``training``, ``swarm``, ``averaging``, ``state``); nothing above.
"""
