"""hivemind's private API as we use it (averaging/hivemind_internals.py, swarm/p2pd_internals.py) is the installed
hivemind's: a version whose internals differ fails here, naming the attribute and the version, rather than in
the middle of a round.

Checked: the pinned version; every private method we override, copy, call or patch, with the parameters we rely
on; the source of every hivemind method we copied (or whose body we depend on) against the sha256 recorded when
we did; every attribute we read, on real objects (a DHT, an averager process and an all-reduce on loopback);
and that no other module of ours touches those names but through the accessors.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib
import inspect
import time
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.averaging.control import StepControl
from hivemind.dht import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture

import diloco_peer
from diloco_peer.averaging import hivemind_internals
from diloco_peer.averaging.allreduce import ExactAllReduceRunner
from diloco_peer.averaging.hivemind_internals import AVERAGER, CONTAINER, CONTROL, MATCHMAKING, REDUCER, RUNNER
from diloco_peer.averaging.pseudo_gradient_averager import PseudoGradientAverager
from diloco_peer.averaging.robust_aggregation import CheckedPartReducer, Limits
from diloco_peer.swarm import p2pd_internals
from diloco_peer.swarm.p2pd_internals import HIVEMIND_VERSION, P2P_CLASS, PrivateUse, p2pd_client

INVENTORY = hivemind_internals.INVENTORY + p2pd_internals.INVENTORY
METHODS = [entry for entry in INVENTORY if entry.use != "read"]
READS = [entry for entry in INVENTORY if entry.use == "read"]
OURS = {AVERAGER: PseudoGradientAverager, RUNNER: ExactAllReduceRunner, REDUCER: CheckedPartReducer}
"""Our subclass of each hivemind class whose methods we override or copy."""
INTERNALS = {Path(hivemind_internals.__file__), Path(p2pd_internals.__file__)}


def _label(entry: PrivateUse) -> str:
    return f"{entry.owner.rsplit('.', 1)[1]}.{entry.name}"


def _differs(entry: PrivateUse, what: str) -> str:
    return (f"hivemind {hivemind.__version__}: {entry.owner}.{entry.name} {what} (our inventory describes hivemind "
            f"{HIVEMIND_VERSION}; used by {entry.where}): look at our use before upgrading")


def _owner(entry: PrivateUse) -> type:
    module, _, name = entry.owner.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_installed_hivemind_is_the_pinned_one():
    assert hivemind.__version__ == HIVEMIND_VERSION, (
        f"hivemind {hivemind.__version__} is installed, its internals are known for {HIVEMIND_VERSION} "
        f"(pyproject.toml pins it): check every entry of the inventories, then update HIVEMIND_VERSION")


@pytest.mark.parametrize("entry", METHODS, ids=_label)
def test_every_private_method_we_rely_on_exists_with_our_parameters(entry):
    method = getattr(_owner(entry), entry.name, None)
    assert callable(method), _differs(entry, "is gone")
    parameters = list(inspect.signature(method).parameters)
    at = [parameters.index(p) if p in parameters else -1 for p in entry.params]
    assert -1 not in at and at == sorted(at), _differs(entry, f"takes {parameters}, we rely on {list(entry.params)}")
    if entry.use in ("override", "copy"):
        ours = OURS[entry.owner]
        assert entry.name in vars(ours), f"{ours.__name__} no longer overrides {entry.name}: update the inventory"
        for kind in (inspect.iscoroutinefunction, inspect.isasyncgenfunction):
            assert kind(method) == kind(vars(ours)[entry.name]), _differs(entry, f"is no longer {kind.__name__[2:]}")


@pytest.mark.parametrize("entry", [entry for entry in INVENTORY if entry.source_sha256], ids=_label)
def test_the_hivemind_methods_we_copied_are_unchanged(entry):
    source = inspect.getsource(getattr(_owner(entry), entry.name))
    assert hashlib.sha256(source.encode()).hexdigest() == entry.source_sha256, _differs(
        entry, f"changed since we {'copied' if entry.use == 'copy' else 'relied on'} it: compare it with our "
               f"{'copy' if entry.use == 'copy' else 'use'}, then record its new sha256")


class _Probe(PseudoGradientAverager):
    """Our averager, with one more request: which of these attributes are missing, in the averager process."""

    async def _missing(self, names: list[tuple[str, str]], future: MPFuture) -> None:
        objects = {AVERAGER: self, MATCHMAKING: getattr(self, "_matchmaking", None)}
        future.set_result([(owner, name) for owner, name in names if not hasattr(objects[owner], name)])


async def _one_solo_allreduce(dht: DHT) -> tuple[dict, list[torch.Tensor]]:
    """Our runner in a group of one, run to the end: the objects whose attributes we read, and its output."""
    p2p = await dht.replicate_p2p()
    try:
        runner = ExactAllReduceRunner(
            traffic=torch.zeros(5, dtype=torch.int64), limits=Limits(), on_offense=lambda *_: None,
            p2p=p2p, servicer_type=PseudoGradientAverager, prefix="internals", group_id=b"group",
            tensors=[torch.arange(6, dtype=torch.float32)], ordered_peer_ids=[p2p.peer_id], peer_fractions=(1.0,))
        step = StepControl(scheduled_time=0.0, deadline=1.0, allow_retries=True, weight=1.0, data_for_gather=b"")
        step.attach(MPFuture(), MPFuture())  # (as the averager's step does: its __del__ reads the trigger)
        objects = {RUNNER: runner, CONTAINER: runner.tensor_part_container, REDUCER: runner.tensor_part_reducer,
                   P2P_CLASS: p2p, CONTROL: step}
        missing = [(entry.owner, entry.name) for entry in READS
                   if entry.owner in objects and not hasattr(objects[entry.owner], entry.name)]
        missing += [(P2P_CLASS, f"_client.{name}") for name in ("connect", "disconnect")
                    if not hasattr(p2pd_client(p2p), name)]
        return missing, [tensor async for tensor in runner]
    finally:
        await p2p.shutdown()


@pytest.mark.slow
@pytest.mark.light
def test_every_private_attribute_we_read_exists_on_real_objects():
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = None
    try:
        averager = _Probe([torch.zeros(4)], dht, prefix="internals", start=True)
        in_process = [(e.owner, e.name) for e in READS if e.owner in (AVERAGER, MATCHMAKING)]
        in_process += [(e.owner, e.name) for e in METHODS if e.owner == MATCHMAKING]  # patched on the instance
        future = MPFuture()
        hivemind_internals.send_to_averager_process(averager, "_missing", in_process, future=future)
        missing = future.result(timeout=30)
        found, outputs = asyncio.run(asyncio.wait_for(_one_solo_allreduce(dht), 30))
        missing += found
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    assert not missing, (f"hivemind {hivemind.__version__} lacks {missing} on real objects (our inventory describes "
                         f"hivemind {HIVEMIND_VERSION})")
    torch.testing.assert_close(torch.cat(outputs), torch.arange(6, dtype=torch.float32))  # alone: our own values


class _StaleProbe(PseudoGradientAverager):
    """Our averager, asked in its process how its matchmaking answers a join request that waited ``waited`` s."""

    async def _answer_after(self, waited: float, future: MPFuture) -> None:
        hivemind_internals.reject_stale_join_requests(self, lambda context: self._join_arrivals.get(id(context)))
        context = P2PContext(handle_name="rpc_join_group", local_id=self.peer_id, remote_id=self.peer_id)
        self._join_arrivals[id(context)] = time.monotonic() - waited
        reply = self._matchmaking._check_reasons_to_reject(averaging_pb2.JoinRequest(), context)
        future.set_result(averaging_pb2.MessageCode.Name(reply.code))


@pytest.mark.slow
def test_a_leader_turns_away_a_join_request_that_waited_past_half_the_request_timeout():
    """The request's sender gave up after ``request_timeout``: a group formed with it would miss a member."""
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = None
    try:
        averager = _StaleProbe([torch.zeros(4)], dht, prefix="stale", request_timeout=2.0, start=True)
        answers = {}
        for waited in (0.0, 0.9, 1.1, 5.0):
            future = MPFuture()
            hivemind_internals.send_to_averager_process(averager, "_answer_after", waited, future=future)
            answers[waited] = future.result(timeout=30)
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    # not in a step, hivemind's own check says NOT_LOOKING_FOR_GROUP; a stale request is turned away before it
    assert answers == {0.0: "NOT_LOOKING_FOR_GROUP", 0.9: "NOT_LOOKING_FOR_GROUP", 1.1: "BAD_EXPIRATION_TIME",
                       5.0: "BAD_EXPIRATION_TIME"}, answers


def _private_uses(path: Path) -> list[str]:
    """Private names of the inventory that ``path`` touches other than by overriding them (``def`` in a
    subclass, for the entries that say so), calling such an override (``self.<name>``) or hivemind's own
    (``super().<name>``)."""
    private = {entry.name for entry in INVENTORY if entry.name.startswith("_")}
    overridden = {entry.name for entry in INVENTORY if entry.use in ("override", "copy")}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in private - overridden:
            found.append(f"line {node.lineno}: def {node.name}")
        if isinstance(node, ast.Attribute) and node.attr in private:
            through_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
            our_override = getattr(node.value, "id", "") == "self" and node.attr in overridden
            if not (through_super or our_override):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_other_module_touches_hiveminds_private_names_but_through_the_accessors():
    package = Path(diloco_peer.__file__).parent
    uses = {str(path.relative_to(package)): found for path in sorted(package.rglob("*.py"))
            if path not in INTERNALS and (found := _private_uses(path))}
    assert not uses, f"hivemind's private names used outside the internals modules: {uses}"


def test_the_scan_finds_a_private_read(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f(self, averager):\n"
                      "    return averager._running_groups, super()._step(), self._step(), self._outer_pipe\n")
    assert _private_uses(sneaky) == ["line 2: ._running_groups", "line 2: ._outer_pipe"]
