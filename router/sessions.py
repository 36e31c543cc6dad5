"""Sessions between turns: the load a replica will see again that its queue does not show yet.

A conversation or agent program sends a turn, waits (the user thinks, a tool runs) and sends the
next turn, which the router sends back where its history is cached. While it waits it has no
request anywhere, so a replica hosting many waiting programs looks idle, and new programs pile
onto it. While a session is parked between turns (for at most ttl_s), the replica that served its
last turn expects its next turn, with as many uncached prompt tokens as the last one had, times
the chance that it comes back: the share of parked sessions that did come back within ttl_s,
counted apart for sessions after their first turn (many callers send one request per session id)
and after a later one.
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
    expected_tokens: float  # uncached prompt tokens its next turn brings, times the chance that it comes


@dataclass(slots=True)
class _ReturnRate:
    """How many parked sessions came back within ttl_s and how many did not; the starting counts are
    the assumption before any session was seen: one that came back once returns, a new one does not."""
    returned: int
    left: int

    @property
    def value(self) -> float:
        return self.returned / (self.returned + self.left)


class ParkedSessions:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._counted: dict[str, _Parked] = {}  # parked within ttl_s, oldest first
        self._remembered: dict[str, _Parked] = {}  # parked within REMEMBER_S, oldest first
        self._return_rates = {False: _ReturnRate(0, 1), True: _ReturnRate(1, 0)}  # by "came back before"
        self._expected_tokens: Counter[str] = Counter()  # replica -> what its counted sessions will bring
        self._num_counted: Counter[str] = Counter()  # replica -> its counted sessions

    def arrive(self, session_id: str) -> int:
        """A turn of the session arrives: it is parked no more. Returns the turns it finished before."""
        parked = self._counted.pop(session_id, None)
        if parked is not None:
            self._uncount(parked)
            self._return_rates[parked.num_turns >= 2].returned += 1
        parked = self._remembered.pop(session_id, None)
        return parked.num_turns if parked else 0

    def park(self, session_id: str, replica_id: str, num_turns: int, num_uncached_tokens: int, now: float) -> None:
        """The session's turn number num_turns, num_uncached_tokens of its prompt not cached when routed,
        finished on replica_id. A finish reported after its next turn arrived parks nothing."""
        remembered = self._remembered.get(session_id)
        if remembered is not None and remembered.num_turns > num_turns:
            return
        self._uncount(self._counted.pop(session_id, None))
        self._remembered.pop(session_id, None)  # re-inserted below, so both stay oldest first
        expected = num_uncached_tokens * self._return_rates[num_turns >= 2].value
        self._remembered[session_id] = self._counted[session_id] = _Parked(replica_id, now, num_turns, expected)
        self._expected_tokens[replica_id] += expected
        self._num_counted[replica_id] += 1

    def remember(self, session_id: str, replica_id: str, num_turns: int, now: float) -> None:
        """The session's turn number num_turns went to replica_id: its next turn is a later turn, whether it
        arrives before this one's finish is reported, or after its booking expired with no finish reported."""
        self._remembered.pop(session_id, None)
        self._remembered[session_id] = _Parked(replica_id, now, num_turns, 0.0)

    def expected_tokens(self, session_turn: int, num_uncached_tokens: int) -> float:
        """What a session is expected to bring per turn while its turn session_turn (0: no session) runs."""
        if session_turn == 0:
            return 0.0
        return num_uncached_tokens * (self._return_rates[False].value if session_turn == 1 else 1.0)

    def returning_tokens(self, replica_id: str) -> float:
        """Uncached prompt tokens the sessions parked on the replica are expected to bring."""
        return self._expected_tokens[replica_id]

    def num_parked(self, replica_id: str) -> int:
        """Sessions parked on the replica within ttl_s."""
        return self._num_counted[replica_id]

    def expire(self, now: float) -> None:
        while self._counted and now - next(iter(self._counted.values())).parked_at >= self.ttl_s:
            parked = self._counted.pop(next(iter(self._counted)))
            self._uncount(parked)
            self._return_rates[parked.num_turns >= 2].left += 1
        while self._remembered and now - next(iter(self._remembered.values())).parked_at >= REMEMBER_S:
            del self._remembered[next(iter(self._remembered))]

    def remove_replica(self, replica_id: str) -> None:
        for sessions in (self._counted, self._remembered):
            for session_id in [s for s, parked in sessions.items() if parked.replica_id == replica_id]:
                del sessions[session_id]
        self._expected_tokens.pop(replica_id, None)
        self._num_counted.pop(replica_id, None)

    def _uncount(self, parked: _Parked | None) -> None:
        if parked is not None:
            self._expected_tokens[parked.replica_id] -= parked.expected_tokens
            self._num_counted[parked.replica_id] -= 1
