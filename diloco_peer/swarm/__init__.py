"""The swarm: how a peer finds the others and what it tells them.

Owns: joining the DHT through bootstrap nodes (``join.py``) with a checked identity and addresses
(``addresses.py``), admission to a closed swarm (``admission.py``), the run's config as its owner publishes it
and a joiner takes it (``run_config.py``, signed with the owner's libp2p key: ``owner_key.py``), the signed
progress records, the round gate and the swarm's consensus on epoch and state (``progress.py``; the records in the
DHT and the validators every node installs: ``progress_store.py``), and how others reach us: reachability probes
(``reachability.py``) and circuit relays (``relay.py``); every use of hivemind's private p2p API
(``p2pd_internals.py``: the p2pd client, the p2pd command-line patch).
Imports: ``config`` and ``lifecycle`` only (and hivemind); never training, averaging, state or anything above.
"""
