"""The per-peer event log and the follower the demo uses for live progress."""

from diloco_peer.observe.events import EventFollower, EventLog, read_events


def test_follower_sees_only_new_complete_lines(tmp_path):
    path = tmp_path / "peer.jsonl"
    follower = EventFollower(path)
    assert follower.new_events() == []  # the peer has not started yet
    log = EventLog(path)
    log.write("start", peer="p")
    log.write("round", round=1)
    assert [e["event"] for e in follower.new_events()] == ["start", "round"]
    assert follower.new_events() == []
    with path.open("a") as f:
        f.write('{"event": "round", "round"')  # a line the peer is still writing
    assert follower.new_events() == []
    assert [e["event"] for e in read_events(path)] == ["start", "round"]
    with path.open("a") as f:
        f.write(": 2}\n")
    assert follower.new_events() == [{"event": "round", "round": 2}]
    log.close()
