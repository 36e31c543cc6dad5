"""Continuum's KV pins: when a turn of an agent program ends in a tool call, its blocks stay held
for the program's next turn, for a time-to-live predicted from the tool gaps observed so far; once
that turn has arrived, until it has run (however long it waits for admission).

A pin never costs a running request: the scheduler releases pins (expired ones at the start of each
step, then the pin of the program that came last) before it preempts. A waiting request releases pins
that have time left only when nothing runs, or once it has waited pin_max_wait_s and as long as the pin's
history would take the replica to recompute.
"""
import heapq
import itertools
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from replica.request import Request

_GAPS_PER_PROGRAM = 8
_GAPS_OVERALL = 256
PROGRAMS_REMEMBERED = 4096  # programs whose gaps, last finish or first arrival are kept; the oldest go first
_MIN_GAPS = 3  # observed gaps a quantile is taken over; fewer: the next source down
_TTL_PERCENTILE = 90  # of the observed gaps


class ToolGapEstimator:
    """How long a program takes to send its next turn after one finished: the 0.9 quantile of its own
    recent gaps once it has shown a few, else of every program's, else a configured default;
    capped by max_s."""

    def __init__(self, default_s: float, max_s: float):
        self.default_s = default_s
        self.max_s = max_s
        self._overall: deque[float] = deque(maxlen=_GAPS_OVERALL)
        self._programs: OrderedDict[str, deque[float]] = OrderedDict()
        self._finished_at: OrderedDict[str, float] = OrderedDict()  # a program that never comes back ages out

    def turn_finished(self, session_id: str, now: float) -> None:
        _remember(self._finished_at, session_id, now)

    def turn_arrived(self, session_id: str, now: float) -> bool:
        """Record the gap since the program's last turn finished; False when none is known."""
        finished_at = self._finished_at.pop(session_id, None)
        if finished_at is None:
            return False
        gaps = self._programs.get(session_id) or deque(maxlen=_GAPS_PER_PROGRAM)
        gaps.append(now - finished_at)
        _remember(self._programs, session_id, gaps)
        self._overall.append(now - finished_at)
        return True

    def forget(self, session_id: str) -> None:
        """The program ended (its last turn, or an abort)."""
        self._finished_at.pop(session_id, None)
        self._programs.pop(session_id, None)

    def ttl(self, session_id: str) -> float:
        for gaps in (self._programs.get(session_id, ()), self._overall):
            if len(gaps) >= _MIN_GAPS:
                return min(statistics.quantiles(gaps, n=100, method="inclusive")[_TTL_PERCENTILE - 1], self.max_s)
        return min(self.default_s, self.max_s)


def _remember(recent: OrderedDict, key: str, value) -> None:
    """recent[key] = value as its most recent entry; past PROGRAMS_REMEMBERED entries the oldest goes."""
    recent.pop(key, None)
    recent[key] = value
    if len(recent) > PROGRAMS_REMEMBERED:
        recent.popitem(last=False)


@dataclass(slots=True)
class Pin:
    """Held from the turn's finish until the program's next turn finishes (and pins its own blocks),
    or until it expires: also while the next turn runs, so that a preempted next turn finds its
    history still there. Once the next turn has arrived the pin no longer expires: the time the turn
    waits for admission is not part of the tool gap its TTL predicted."""
    request: Request  # the finished turn whose blocks are held
    pinned_at: float
    expires_at: float
    hit: bool = False  # the program's next turn was admitted while it held the history
    next_turn_arrived_at: float | None = None

    @property
    def next_turn_arrived(self) -> bool:
        return self.next_turn_arrived_at is not None


class Pins:
    """At most one pin per program: a newer turn's pin replaces the older one."""

    def __init__(self) -> None:
        self._by_session: dict[str, Pin] = {}
        self._by_request_id: dict[str, str] = {}  # request id -> its session
        # (expires_at, order, pin), soonest first. Entries of pins that already ended, or whose next turn
        # arrived, stay until they reach the top (within pin_ttl_max_s), so checking expiry every step
        # costs nothing when none is due.
        self._by_expiry: list[tuple[float, int, Pin]] = []
        self._order = itertools.count()

    def add(self, request: Request, now: float, expires_at: float) -> Pin | None:
        """Pin the request's blocks; returns the program's previous pin, to release."""
        previous = self.pop(request.session_id)
        pin = self._by_session[request.session_id] = Pin(request, now, expires_at)
        self._by_request_id[request.request_id] = request.session_id
        heapq.heappush(self._by_expiry, (expires_at, next(self._order), pin))
        return previous

    def pop(self, session_id: str | None) -> Pin | None:
        pin = self._by_session.pop(session_id, None)
        if pin is not None:
            del self._by_request_id[pin.request.request_id]
        return pin

    def next_turn_arrived(self, session_id: str | None, now: float) -> None:
        """The program's next turn arrived: its pin stops expiring."""
        pin = self._by_session.get(session_id)
        if pin is not None and not pin.next_turn_arrived:
            pin.next_turn_arrived_at = now

    def get(self, session_id: str | None) -> Pin | None:
        return self._by_session.get(session_id)

    def session_of(self, request_id: str) -> str | None:
        return self._by_request_id.get(request_id)

    def pop_expired(self, now: float) -> list[Pin]:
        """The pins whose time is up, oldest pinned first."""
        expired = []
        while self._by_expiry and self._by_expiry[0][0] <= now:
            entry = heapq.heappop(self._by_expiry)
            if self._is_current(entry[2]):
                expired.append(entry)
        return [self.pop(pin.request.session_id) for _, _, pin in sorted(expired, key=lambda entry: entry[1])]

    def pop_first(self, key: Callable[[Pin], object], keep: str | None,
                  eligible: Callable[[Pin], bool] | None = None) -> Pin | None:
        """The pin that key orders first among the eligible ones (None: all), other than program keep's (its own
        turn needs it)."""
        pins = (pin for pin in self._by_session.values()
                if pin.request.session_id != keep and (eligible is None or eligible(pin)))
        pin = min(pins, key=key, default=None)
        return pin and self.pop(pin.request.session_id)

    def _is_current(self, pin: Pin) -> bool:
        """Still held and still expiring."""
        return self._by_session.get(pin.request.session_id) is pin and not pin.next_turn_arrived

    def pop_all(self) -> list[Pin]:
        return [self.pop(session_id) for session_id in list(self._by_session)]

    def __contains__(self, session_id: str | None) -> bool:
        return session_id in self._by_session

    def __len__(self) -> int:
        return len(self._by_session)

    def __iter__(self):
        return iter(self._by_session.values())
