"""Sessions between turns: the load a replica will see again that its queue does not show yet.

A conversation or agent program sends a turn, waits (the user thinks, a tool runs) and sends the
next turn, which the router sends back where its history is cached. While it waits it has no
request anywhere, so a replica hosting many waiting programs looks idle, and new programs pile
onto it. A session that has come back at least once has shown that it comes back: while it is
parked between turns (for at most ttl_s) the replica that served its last turn expects its next
turn, with as many uncached prompt tokens as the last one had.
"""
from collections import Counter
from dataclasses import dataclass

# How long a session's turn count is remembered after its last turn finished, so that a turn that
# comes after a long pause is still known as a later turn, not a new session.
REMEMBER_S = 600.0


@dataclass(slots=True)
class _Parked:
    replica_id: str
    parked_at: float
    num_turns: int  # turns finished so far
    num_next_tokens: int  # uncached prompt tokens its next turn is expected to bring

    @property
    def returns(self) -> bool:
        return self.num_turns >= 2


class ParkedSessions:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._counted: dict[str, _Parked] = {}  # parked within ttl_s, oldest first
        self._remembered: dict[str, _Parked] = {}  # parked within REMEMBER_S, oldest first
        self._returning_tokens: Counter[str] = Counter()  # replica -> what its counted sessions will bring
        self._num_counted: Counter[str] = Counter()  # replica -> its counted sessions

    def arrive(self, session_id: str) -> int:
        """A turn of the session arrives: it is parked no more. Returns the turns it finished before."""
        self._uncount(self._counted.pop(session_id, None))
        parked = self._remembered.pop(session_id, None)
        return parked.num_turns if parked else 0

    def park(self, session_id: str, replica_id: str, num_turns: int, num_uncached_tokens: int, now: float) -> None:
        """The session's turn number num_turns, num_uncached_tokens of its prompt not cached when routed,
        finished on replica_id."""
        self.arrive(session_id)
        parked = self._remembered[session_id] = _Parked(replica_id, now, num_turns, num_uncached_tokens)
        if parked.returns:
            self._counted[session_id] = parked
            self._returning_tokens[replica_id] += num_uncached_tokens
            self._num_counted[replica_id] += 1

    def returning_tokens(self, replica_id: str) -> int:
        """Uncached prompt tokens the sessions parked on the replica that have come back before will bring."""
        return self._returning_tokens[replica_id]

    def num_parked(self, replica_id: str) -> int:
        """Sessions parked on the replica that have come back before."""
        return self._num_counted[replica_id]

    def expire(self, now: float) -> None:
        while self._counted and now - next(iter(self._counted.values())).parked_at >= self.ttl_s:
            self._uncount(self._counted.pop(next(iter(self._counted))))
        while self._remembered and now - next(iter(self._remembered.values())).parked_at >= REMEMBER_S:
            del self._remembered[next(iter(self._remembered))]

    def remove_replica(self, replica_id: str) -> None:
        for sessions in (self._counted, self._remembered):
            for session_id in [s for s, parked in sessions.items() if parked.replica_id == replica_id]:
                del sessions[session_id]
        self._returning_tokens.pop(replica_id, None)
        self._num_counted.pop(replica_id, None)

    def _uncount(self, parked: _Parked | None) -> None:
        if parked is not None:
            self._returning_tokens[parked.replica_id] -= parked.num_next_tokens
            self._num_counted[parked.replica_id] -= 1
