"""The peer's state outside a round: downloading the swarm's state, and checkpoints on disk.

Owns: state sync, by which a newcomer or a peer that fell behind downloads the swarm's outer weights,
momentum and epoch from verified donors (``state_sync.py``), and atomic checkpoints written in the
background and resumed from (``checkpoint.py``); the state a peer syncs to, voted by the swarm's records
(``target.py``), and what a sync reports (``sync_result.py``).
Imports: ``config``, ``lifecycle``, ``training``, ``swarm`` and ``averaging``; never ``observe`` or above.
"""
