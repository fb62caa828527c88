"""Process lifecycle: every process ends when asked, and nothing it started outlives it.

Owns: the reaper, a watcher process that kills a dead process's children and removes its network namespaces
(``reaper.py``); stop requests: a clean leave on the first signal, an exit at once on the second, a deadline
past the grace period (``shutdown.py``); and the bounded way every blocking call into hivemind's child
processes is made, so that none can keep a process from exiting (``hivemind_calls.py``).
Imports: nothing of diloco_peer outside this subpackage (and neither torch nor hivemind): every layer may use it.
"""
