"""Operator and test tools: never part of a running peer.

Owns: the local demo swarm (``demo.py``), the in-process DiLoCo simulator (``simulate.py``), the network
test bed of namespaces, shaped links and home routers (``netbed.py``) and seeded churn schedules
(``churn.py``).
Imports: anything below; the peer daemon is started as a separate process, never imported.
"""
