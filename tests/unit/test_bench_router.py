"""`trnd bench router --events` spreads a session's turns over the router replicas: taking the replicas in turn
kept every session on one replica (16 sessions a round over 2), so a router guessing from its own routes
knew every history and events could not show what they add (docs/RESULTS.md, "Past one machine")."""

from trnd.bench.router import replica


def test_replicas_see_some_of_a_sessions_turns_not_all():
    sessions, turns = 16, 6
    seen = [{replica(i, t, 2) for t in range(turns)} for i in range(sessions)]
    assert sum(len(s) == 2 for s in seen) >= sessions * 3 // 4  # most sessions cross replicas between turns
    load = [sum(replica(i, t, 2) == r for i in range(sessions) for t in range(turns)) for r in range(2)]
    assert min(load) >= sessions * turns // 3  # and neither replica takes (nearly) all the traffic
