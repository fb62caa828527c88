"""A forked client: the normal ``diloco-peer`` with a few of its functions replaced, as an attacker who read the
code would do it. Not the built-in fault injection (``config/faults.py``), which only covers what its hooks reach.

    python tests/attacker.py ATTACK[,ATTACK...] -- join <bootstrap> --name evil --set ...

Attacks (each one replaces one function of the client, in this process; hivemind forks its averager from it,
so the replacement holds there too):

- ``lie_from_start``: every progress record it stores claims epoch 10**6, a made-up state hash and
  ``joined=True``, from its first record on (before the honest peers' start-up check, when it starts first);
  it trains and averages honestly otherwise.
- ``poison_momentum``: the state it serves to a syncing peer carries the true weights and epoch, with the outer
  momentum x100.
- ``sign_flip:K``: the pseudo-gradient it sends to every all-reduce is its own times -K.
"""

from __future__ import annotations

import sys

LIE_EPOCH = 10**6


def lie_from_start(_: str) -> None:
    from diloco_peer.swarm.progress import SwarmProgress

    store = SwarmProgress._store

    async def _store(self, value):
        if value is not None:
            value = {**value, "epoch": LIE_EPOCH, "round": LIE_EPOCH, "joined": True, "state_hash": "f" * 64}
        await store(self, value)

    SwarmProgress._store = _store


def poison_momentum(_: str) -> None:
    from diloco_peer.state.state_sync import StateSync

    current_state = StateSync._current_state

    def _current_state(self):
        metadata, tensors = current_state(self)
        n = len(self.outer.params)
        return metadata, tensors[:n] + [t * 100 for t in tensors[n:]]

    StateSync._current_state = _current_state


def sign_flip(factor: str) -> None:
    from diloco_peer.averaging.averager import RoundAverager

    average, k = RoundAverager.average, float(factor)

    async def _average(self, pseudo_gradient, *args, **kwargs):
        return await average(self, [-k * t for t in pseudo_gradient], *args, **kwargs)

    RoundAverager.average = _average


ATTACKS = {"lie_from_start": lie_from_start, "poison_momentum": poison_momentum, "sign_flip": sign_flip}


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        raise SystemExit("usage: attacker.py ATTACK[,ATTACK...] -- <diloco-peer arguments>")
    for attack in argv[0].split(","):
        name, _, arg = attack.partition(":")
        if name not in ATTACKS:
            raise SystemExit(f"unknown attack '{name}': use one of {', '.join(ATTACKS)}")
        ATTACKS[name](arg)
    from diloco_peer.cli import main as diloco_main

    return diloco_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
