"""Training a replica: the model, the data it reads, the inner AdamW steps and the outer Nesterov step.

Owns: the Llama-style model (``model.py``), the token stream of this peer's shard (``data.py``: its text
from ``documents.py``, tokenized by ``tokenizer.py``, prepared ahead by ``prepare.py`` into
``token_shards.py``'s files, or streamed by ``streaming.py``), the inner optimizer and its steps
(``trainer.py``) and the outer optimizer: the pseudo-gradient and the outer step applied with the swarm's
average (``outer_optimizer.py``).
Imports: ``config`` only (and torch, numpy; the Hugging Face ``tokenizers``, ``datasets`` and ``pyarrow`` where
a tokenizer.json, a streamed dataset or a .parquet file is used). Nothing here knows about peers or the network.
"""
