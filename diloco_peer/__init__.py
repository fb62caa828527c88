"""diloco-peer: a peer-to-peer volunteer training daemon for language models (DiLoCo on hivemind)."""

__version__ = "0.1.0"
