from router.sessions import ParkedSessions


def test_a_parked_session_counts_as_often_as_sessions_parked_after_as_many_turns_came_back():
    sessions = ParkedSessions(ttl_s=30.0)
    sessions.park("x", "a", 1, 100, now=0.0)
    assert sessions.returning_tokens("a") == 0  # before any came back, one turn is all a session sends
    assert sessions.arrive("x") == 1  # came back: 1 of 2, with the assumption's one that did not
    sessions.park("y", "a", 1, 100, now=1.0)
    assert sessions.returning_tokens("a") == 50
    sessions.park("x", "b", 2, 40, now=2.0)
    assert sessions.returning_tokens("b") == 40  # after a later turn, sessions are assumed to come back

    sessions.expire(now=31.0)  # y did not come back within 30 s: 1 of 3
    assert (sessions.returning_tokens("a"), sessions.num_parked("a")) == (0, 0)
    sessions.park("z", "a", 1, 90, now=31.0)
    assert sessions.returning_tokens("a") == 30
    sessions.expire(now=32.0)  # x neither, after its second turn: 1 of 2
    sessions.park("w", "b", 3, 40, now=32.0)
    assert (sessions.returning_tokens("b"), sessions.num_parked("b")) == (20, 1)
    assert sessions.arrive("x") == 2  # its turn count outlives the ttl
