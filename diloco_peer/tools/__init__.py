"""Operator and test tools: never part of a running peer.

Owns: the harness that starts a swarm of real processes on this machine and reaps them (``local_swarm.py``: the
demo's, the tests' and the benchmarks') and forks their ``diloco-peer`` processes from a warm process that imported
torch and hivemind once (``zygote.py``), the local demo swarm (``demo.py``), the in-process DiLoCo simulator
(``simulate.py``) and its group all-reduce as the swarm's reducers compute it (``simulated_allreduce.py``), the
network test bed of namespaces, shaped links and home routers (``netbed.py``), slower volunteers on this machine
held to a share of a core (``cpu_quota.py``), seeded churn schedules (``churn.py``), the memory and traffic plan
of a config (``memory_plan.py``, ``plan.py``; ``join`` runs its fit check before the peer starts) and the export
of a checkpoint as a Hugging Face model (``export.py``).
Imports: anything below; the peer daemon runs as a separate process, never inside a tool (the zygote imports it
only to fork processes that run it).
"""
