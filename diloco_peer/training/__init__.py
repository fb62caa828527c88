"""Training a replica: the model, the data it reads, the inner AdamW steps and the outer Nesterov step.

Owns: the Llama-style model (``model.py``), the token stream of this peer's shard (``data.py``), the
inner optimizer and its steps (``trainer.py``) and the outer optimizer: the pseudo-gradient and the
outer step applied with the swarm's average (``outer_optimizer.py``).
Imports: ``config`` only (and torch). Nothing here knows about peers or the network.
"""
