"""Router: everything the router knows about its replicas, and the routing decisions made from it.

No Ray: the router actor is a thin shell around one Router, and simulators and tests drive the
same object. Per replica it keeps the blocks it caches (in the BlockIndex), the last event batch
number applied, its last reported stats, its recent preemptions and the requests routed to it.
Replicas number their event batches 1, 2, 3...; a batch that does not follow the last one applied
(lost, repeated, or from a restarted or never seen replica) is refused and the replica resyncs.

A routed request is booked on its replica: its blocks count as cached there, its prefill as
queued there until the replica's own reports cover it, and it counts as outstanding until the
replica reports it finished. A booking that does not run where it was routed (Serve picked
another replica, the caller left) is rolled back.
"""
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from replica.kv_cache import BlockHash, KVEvent
from replica.scheduler import SchedulerStats
from router.index import BlockIndex
from router.messages import (FinishedRequest, PoolServed, PullSource, ReplicaSnapshot, ReplicaState, RouterSnapshot,
                             RoutingDecision)
from router.policy import Candidate, PolicyConfig, RequestShape, make_policy, pull_token_cost
from router.sessions import ParkedSessions

# A replica's report covers a request routed to it from its second report after the routing on:
# the first may have been sent before the request arrived.
_REPORTS_TO_COVER_A_BOOKING = 2


class PreemptionWindow:
    """Preemptions within the last window_s seconds, from a cumulative counter sampled at each report.

    The oldest sample kept is the last one at or before the window's start: the baseline the
    newest count is compared with.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def record(self, now: float, num_preemptions: int) -> None:
        if self._samples and num_preemptions < self._samples[-1][1]:
            self._samples.clear()  # the counter restarted with the replica
        self._samples.append((now, num_preemptions))
        self._forget_before(now)

    def count(self, now: float) -> int:
        self._forget_before(now)
        return self._samples[-1][1] - self._samples[0][1] if self._samples else 0

    def _forget_before(self, now: float) -> None:
        start = now - self.window_s
        while len(self._samples) > 1 and self._samples[1][0] <= start:
            self._samples.popleft()


class PeerLoadCosts:
    """The replicas' measured costs of loading a token from their node's pool; a replica that has not measured its own
    (no load yet, or none lately) is priced at their median: they run one model on alike machines, and a fixed guess
    far from what they measure sends the cluster's first loads elsewhere than its later ones."""

    def __init__(self) -> None:
        self._costs: dict[str, float] = {}
        self._median: float | None = None
        self._changed = False

    def report(self, replica_id: str, cost: float | None) -> None:
        if self._costs.get(replica_id) == cost:
            return
        if cost is None:
            self._costs.pop(replica_id, None)
        else:
            self._costs[replica_id] = cost
        self._changed = True

    def median(self) -> float | None:
        if self._changed:
            self._median = statistics.median(self._costs.values()) if self._costs else None
            self._changed = False
        return self._median


@dataclass(slots=True)
class PoolDepths:
    """How far into a request's chain, from its first block on, the two pools holding most of it hold it: what a
    replica of any node could pull from another node's pool."""
    deepest: tuple[int, str] = (0, "")  # (blocks, pool)
    second: tuple[int, str] = (0, "")

    def add(self, num_blocks: int, pool: str) -> None:
        if num_blocks > self.deepest[0]:
            self.deepest, self.second = (num_blocks, pool), self.deepest
        elif num_blocks > self.second[0]:
            self.second = (num_blocks, pool)

    def elsewhere(self, pool: str) -> int:
        """Blocks the deepest pool other than this one holds."""
        return self.second[0] if self.deepest[1] == pool else self.deepest[0]


@dataclass(slots=True, eq=False)
class _Booking:
    request_id: str
    replica_id: str
    block_hashes: Sequence[BlockHash]
    num_prompt_tokens: int
    num_computed_tokens: int  # prompt tokens the replica lacked when routed, on its device and in its node's pool
    num_new_blocks: int  # device blocks it takes: those it computes and those it loads from the pool
    routed_at: float
    report_number: int  # the replica's number of reports when the request was routed
    booked_from: int | None  # its blocks from here on count as cached on the replica; None: not booked
    session_id: str | None = None
    session_turn: int = 0  # the how-manieth turn of its session it is
    session_tokens: float = 0.0  # what its session is expected to bring per turn, counted while it runs
    covered: bool = False  # the replica's reports count it


@dataclass(slots=True)
class _Replica:
    preemptions: PreemptionWindow
    snapshot: ReplicaSnapshot | None = None  # None until the first report
    last_seq: int = 0
    num_reports: int = 0
    bookings: dict[str, _Booking] = field(default_factory=dict)
    uncovered: deque[_Booking] = field(default_factory=deque)  # bookings its reports may not count yet
    uncovered_tokens: int = 0
    uncovered_blocks: int = 0
    booked_tokens: int = 0  # computed prompt tokens of every booking: the most prefill they can still need
    booked_context_tokens: int = 0  # prompt tokens of every booking: the context its decodes attend to
    session_tokens: float = 0.0  # what the sessions of its bookings are expected to bring per turn

    def add(self, booking: _Booking) -> None:
        self.bookings[booking.request_id] = booking
        self.uncovered.append(booking)
        self._count_uncovered(booking, +1)
        self._count_booked(booking, +1)

    def remove(self, booking: _Booking) -> None:
        del self.bookings[booking.request_id]
        self._count_booked(booking, -1)
        self._cover(booking)  # it stays in the deque until reported past, counting no more

    def reported(self) -> None:
        self.num_reports += 1
        while self.uncovered and self.num_reports - self.uncovered[0].report_number >= _REPORTS_TO_COVER_A_BOOKING:
            self._cover(self.uncovered.popleft())

    def _cover(self, booking: _Booking) -> None:
        if not booking.covered:
            booking.covered = True
            self._count_uncovered(booking, -1)

    def _count_booked(self, booking: _Booking, sign: int) -> None:
        self.booked_tokens += sign * booking.num_computed_tokens
        self.booked_context_tokens += sign * booking.num_prompt_tokens
        self.session_tokens += sign * booking.session_tokens

    def _count_uncovered(self, booking: _Booking, sign: int) -> None:
        self.uncovered_tokens += sign * booking.num_computed_tokens
        self.uncovered_blocks += sign * booking.num_new_blocks

    def candidate(self, replica_id: str, matched_blocks: int, num_cached_blocks: int, parked_session_tokens: float,
                  now: float) -> Candidate:
        # The sessions it hosts: those with a turn in flight, and the parked ones.
        session_tokens = parked_session_tokens + self.session_tokens
        if self.snapshot is None:
            return Candidate(replica_id, matched_blocks, len(self.bookings), self.uncovered_tokens,
                             num_cached_blocks=num_cached_blocks, num_session_tokens=session_tokens,
                             num_context_tokens=self.booked_context_tokens)
        stats = self.snapshot.stats
        # Our bookings are fresher than the report for what we routed; the report also covers
        # requests other routers sent. Each undercounts, so take the larger.
        num_requests = max(stats.num_running + stats.num_waiting, len(self.bookings))
        # A report counts a waiting request's whole prompt, its cached prefix too (the replica looks
        # it up only at admission), and overcounts a long cached history by all of it; a booking
        # counts what the replica lacked when routed. Both are upper bounds: take the smaller.
        pending = min(stats.num_prefill_tokens_pending + self.uncovered_tokens, self.booked_tokens)
        free_blocks = stats.num_free_blocks - self.uncovered_blocks
        # The share requests hold, those it routed since counted. Blocks only continuum's pins hold are left out: a
        # pin gives them up before a running request is preempted, and where memory is plentiful they delay no one.
        # A replica that does not say its size: as it last reported.
        available = free_blocks + stats.pins.num_releasable_blocks
        kv_usage = min(max(1.0 - available / stats.num_blocks, 0.0), 1.0) if stats.num_blocks else stats.kv_usage
        return Candidate(replica_id, matched_blocks, num_requests, pending, free_blocks, self.preemptions.count(now),
                         num_cached_blocks, session_tokens, self.booked_context_tokens,
                         load_token_cost=stats.host_load_token_cost, kv_usage=kv_usage)


class Router:
    def __init__(self, config: PolicyConfig | None = None, block_size: int = 16, *,
                 clock: Callable[[], float] = time.monotonic, seed: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config = config or PolicyConfig()
        self.block_size = block_size
        self.index = BlockIndex()
        self._clock = clock
        self._policy = make_policy(config, random.Random(seed))
        self._replicas: dict[str, _Replica] = {}
        self._bookings: dict[str, _Booking] = {}  # by request id, oldest first
        self._removed: set[str] = set()
        self._sessions = ParkedSessions(config.session_ttl_s)
        self._decisions: Counter[str] = Counter()
        self._pool_servers: dict[str, PoolServed] = {}  # replica -> where its node's pool is served
        self._load_costs = PeerLoadCosts()

    def choose(self, request_id: str, block_hashes: Sequence[BlockHash], candidates: Sequence[str], *,
               num_prompt_tokens: int | None = None, session_id: str | None = None,
               route_to: str | None = None) -> RoutingDecision:
        """Pick the replica for a request with this block-hash chain and book the request on it.

        num_prompt_tokens defaults to the chain's full blocks; routing the same request id again
        (its first replica refused it) moves its booking. A session's turns share their history's
        prefix, which the index already follows; session_id tells the router which sessions are
        parked between turns, and so will come back, on each replica. route_to: the replica the
        request must go to while it is a candidate (a later choice of n goes where its first went).
        """
        if not candidates:
            raise ValueError("no candidate replicas to route to")
        request, now = self._arrive(request_id, block_hashes, num_prompt_tokens, session_id)
        matched = self.index.match(block_hashes)
        pools = self._pool_depths(block_hashes)
        if route_to in candidates:
            decision = RoutingDecision(route_to, matched.get(route_to, 0), "directed")
            num_fetched = self._num_fetched_blocks(route_to, block_hashes, decision.matched_blocks, pools)
        else:
            options = [self._candidate(replica_id, block_hashes, matched.get(replica_id, 0), now, pools)
                       for replica_id in candidates]
            decision = self._policy.choose(request, options)
            chosen = next(option for option in options if option.replica_id == decision.replica_id)
            num_fetched = chosen.loadable_blocks + chosen.pullable_blocks
        self._book(request_id, decision, request, block_hashes, now, session_id, num_fetched)
        self._decisions[decision.outcome] += 1
        return decision

    def book(self, request_id: str, block_hashes: Sequence[BlockHash], replica_id: str, *,
             num_prompt_tokens: int | None = None, session_id: str | None = None) -> None:
        """Book a request another router routed to replica_id as if choose() had picked it there
        (matched against this router's index), so that it counts before the replica reports it."""
        if replica_id in self._removed:
            return
        request, now = self._arrive(request_id, block_hashes, num_prompt_tokens, session_id)
        decision = RoutingDecision(replica_id, self.index.match(block_hashes).get(replica_id, 0), "booked")
        self._book(request_id, decision, request, block_hashes, now, session_id, self._num_fetched_blocks(
            replica_id, block_hashes, decision.matched_blocks, self._pool_depths(block_hashes)))

    def _arrive(self, request_id: str, block_hashes: Sequence[BlockHash], num_prompt_tokens: int | None,
                session_id: str | None) -> tuple[RequestShape, float]:
        """A request is about to be booked: its shape, and the time, once an earlier booking of it is
        released and its session counts it as arrived."""
        min_prompt_tokens = max(len(block_hashes) * self.block_size, 1)
        if num_prompt_tokens is None:
            num_prompt_tokens = min_prompt_tokens
        if num_prompt_tokens < min_prompt_tokens:
            raise ValueError(f"num_prompt_tokens={num_prompt_tokens} is fewer than the chain's "
                             f"{len(block_hashes)} full blocks of {self.block_size} tokens")
        now = self._clock()
        self._expire(now)
        previous = self._bookings.get(request_id)
        self.release(request_id)
        session_turn = self._session_turn(previous, session_id)
        return RequestShape(len(block_hashes), num_prompt_tokens, self.block_size, session_turn), now

    def routed(self, request_id: str, replica_id: str) -> None:
        """The request went to replica_id after all (Serve's second choice): move its booking there."""
        booking = self._bookings.get(request_id)
        if booking is None or booking.replica_id == replica_id:
            return
        self.release(request_id)
        request = RequestShape(len(booking.block_hashes), booking.num_prompt_tokens, self.block_size,
                               booking.session_turn)
        matched_blocks = self.index.match(booking.block_hashes).get(replica_id, 0)
        decision = RoutingDecision(replica_id, matched_blocks, "fallback")
        self._book(request_id, decision, request, booking.block_hashes, booking.routed_at, booking.session_id,
                   self._num_fetched_blocks(replica_id, booking.block_hashes, matched_blocks,
                                            self._pool_depths(booking.block_hashes)))

    def replica_states(self) -> list[ReplicaState]:
        """What each reporting replica last told: enough for another Router to resync every one of them."""
        return [ReplicaState(replica_id, replica.last_seq, self.index.stored_hashes(replica_id), replica.snapshot.stats,
                             self.index.stored_hashes(replica_id, "host"))
                for replica_id, replica in self._replicas.items() if replica.snapshot is not None]

    def release(self, request_id: str) -> None:
        """The request ended without reaching its replica: roll its booking back. Unknown ids are ignored."""
        booking = self._bookings.pop(request_id, None)
        if booking is None:
            return
        if booking.booked_from is not None:
            self.index.unbook(booking.replica_id, booking.block_hashes, booking.booked_from)
        replica = self._replicas.get(booking.replica_id)
        if replica is not None:
            replica.remove(booking)

    def publish(self, replica_id: str, seq: int, events: list[KVEvent], stats: SchedulerStats,
                finished: list[FinishedRequest]) -> bool:
        """Apply a replica's next event batch; False (no events applied) means: resync it."""
        if replica_id in self._removed:
            return True  # a replica on its way out; it stays forgotten
        replica = self._report(replica_id, stats, finished)
        if seq != replica.last_seq + 1:
            return False
        self.index.apply(replica_id, events)
        replica.last_seq = seq
        return True

    def resync(self, replica_id: str, seq: int, block_hashes: list[BlockHash], stats: SchedulerStats,
               finished: list[FinishedRequest], host_block_hashes: list[BlockHash] | None = None) -> None:
        """Replace a replica's cached blocks with a full list; its next batch is expected as seq + 1. Its node
        pool's blocks are replaced too if given (a replica's own resync brings them in its next batch)."""
        if replica_id in self._removed:
            return
        replica = self._report(replica_id, stats, finished)
        self.index.resync(replica_id, block_hashes)
        if host_block_hashes is not None:
            self.index.resync(replica_id, host_block_hashes, "host")
        replica.last_seq = seq

    def serve_pool(self, replica_id: str, served: PoolServed) -> None:
        """The replica serves its node's pool: replicas of other nodes may pull from it."""
        if replica_id not in self._removed:
            self._pool_servers[replica_id] = served

    def pools_elsewhere(self, replica_id: str) -> bool:
        """Whether a pool besides the replica's own node's is served: only then may it pull."""
        own = self._pool_servers.get(replica_id)
        return own is not None and any(served.pool != own.pool for served in self._pool_servers.values())

    def pull_source(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> PullSource | None:
        """Where the replica should pull the blocks of the chain that neither it nor its node's pool holds, from
        the other pool that holds the most of them; None where none does, or where pulling a token costs the
        replica (its measured pull time against its compute rate) at least what computing one does."""
        own = self._pool_servers.get(replica_id)
        if own is None:
            return None
        start = self.index.match(block_hashes, booked=False).get(replica_id, 0)
        start += self.index.host_run(replica_id, block_hashes, start)
        runs = {served.address: self.index.host_run(source, block_hashes, start)
                for source, served in self._pool_servers.items() if served.pool != own.pool}
        address = max(runs, key=runs.__getitem__, default=None)
        if address is None or not runs[address]:
            return None
        if self._pull_token_cost(replica_id) >= 1:
            return None
        return PullSource(address, start, runs[address])

    def remove_replica(self, replica_id: str) -> None:
        self._removed.add(replica_id)
        self._pool_servers.pop(replica_id, None)
        self._load_costs.report(replica_id, None)
        replica = self._replicas.pop(replica_id, None)
        if replica is not None:
            for request_id in replica.bookings:
                del self._bookings[request_id]
        self._sessions.remove_replica(replica_id)
        self.index.remove_replica(replica_id)

    def num_in_flight(self, replica_id: str) -> int:
        """Requests routed to the replica and not finished yet."""
        replica = self._replicas.get(replica_id)
        return len(replica.bookings) if replica else 0

    def snapshot(self) -> RouterSnapshot:
        replicas = {}
        for replica_id, replica in self._replicas.items():
            if replica.snapshot is not None:
                replica.snapshot.index_blocks = self.index.num_blocks(replica_id)
                replica.snapshot.index_host_blocks = self.index.num_blocks(replica_id, "host")
                replica.snapshot.num_in_flight = len(replica.bookings)
                replica.snapshot.num_parked_sessions = self._sessions.num_parked(replica_id)
                replicas[replica_id] = replica.snapshot
        return RouterSnapshot(self.config.policy, replicas, dict(self._decisions))

    def _candidate(self, replica_id: str, block_hashes: Sequence[BlockHash], matched_blocks: int,
                   now: float, pools: PoolDepths | None = None) -> Candidate:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return Candidate(replica_id, matched_blocks)
        candidate = replica.candidate(replica_id, matched_blocks, self.index.num_blocks(replica_id),
                                      self._sessions.returning_tokens(replica_id), now)
        candidate.loadable_blocks, candidate.pullable_blocks, candidate.pull_token_cost = self._fetchable(
            replica_id, block_hashes, matched_blocks, pools)
        if candidate.loadable_blocks and candidate.load_token_cost is None:
            candidate.load_token_cost = self._load_costs.median()
        return candidate

    def _fetchable(self, replica_id: str, block_hashes: Sequence[BlockHash], matched_blocks: int,
                   pools: PoolDepths | None) -> tuple[int, int, float]:
        """Blocks of the chain past its device hit the replica would load from its node's pool, and past those, pull
        from another node's while pulling beats computing, and what pulling a token costs it (0 if it pulls none)."""
        loadable = self.index.host_run(replica_id, block_hashes, matched_blocks)
        own = self._pool_servers.get(replica_id)
        if pools is None or own is None:
            return loadable, 0, 0.0
        pullable = pools.elsewhere(own.pool) - matched_blocks - loadable
        cost = self._pull_token_cost(replica_id) if pullable > 0 else 1.0
        return (loadable, pullable, cost) if cost < 1 else (loadable, 0, 0.0)

    def _num_fetched_blocks(self, replica_id: str, block_hashes: Sequence[BlockHash], matched_blocks: int,
                            pools: PoolDepths | None) -> int:
        loadable, pullable, _ = self._fetchable(replica_id, block_hashes, matched_blocks, pools)
        return loadable + pullable

    def _pool_depths(self, block_hashes: Sequence[BlockHash]) -> PoolDepths | None:
        """None unless the pools of two nodes or more are served (only then may a replica pull)."""
        if len(self._pool_servers) < 2:
            return None
        depths, seen = PoolDepths(), set()
        for replica_id, served in self._pool_servers.items():
            if served.pool not in seen:
                seen.add(served.pool)
                depths.add(self.index.host_run(replica_id, block_hashes, 0), served.pool)
        return depths if len(seen) > 1 else None

    def _pull_token_cost(self, replica_id: str) -> float:
        replica = self._replicas.get(replica_id)
        stats = replica.snapshot.stats if replica and replica.snapshot else None
        return pull_token_cost(self.config, stats and stats.pull_seconds_per_token,
                               stats and stats.compute_seconds_per_token)

    def _session_turn(self, previous: _Booking | None, session_id: str | None) -> int:
        if previous is not None:
            return previous.session_turn  # the same turn, routed again
        return 1 + self._sessions.arrive(session_id) if session_id is not None else 0

    def _book(self, request_id: str, decision: RoutingDecision, request: RequestShape,
              block_hashes: Sequence[BlockHash], now: float, session_id: str | None, num_fetched_blocks: int) -> None:
        """num_fetched_blocks: of the chain past its device hit, the blocks the replica loads or pulls."""
        replica = self._replica(decision.replica_id)
        matched = decision.matched_blocks
        booked_from = matched if self.config.assume_routed_prefix_cached else None
        uncached = request.num_uncached_tokens(matched)
        computed = request.num_uncached_tokens(matched + num_fetched_blocks)
        booking = _Booking(request_id, decision.replica_id, block_hashes, request.num_prompt_tokens, computed,
                           -(-uncached // self.block_size), now, replica.num_reports, booked_from, session_id,
                           request.session_turn, self._sessions.expected_tokens(request.session_turn, computed))
        if booked_from is not None:
            self.index.book(decision.replica_id, block_hashes, booked_from)
        if session_id is not None:
            self._sessions.remember(session_id, decision.replica_id, request.session_turn, now)
        replica.add(booking)
        self._bookings[request_id] = booking

    def _expire(self, now: float) -> None:
        self._sessions.expire(now)
        while self._bookings:
            booking = next(iter(self._bookings.values()))
            if now - booking.routed_at < self.config.booking_ttl_s:
                return
            self.release(booking.request_id)

    def _report(self, replica_id: str, stats: SchedulerStats, finished: list[FinishedRequest]) -> _Replica:
        replica = self._replica(replica_id)
        replica.reported()
        now = self._clock()
        replica.preemptions.record(now, stats.num_preemptions)
        if replica.snapshot is None:
            replica.snapshot = ReplicaSnapshot(stats)
        replica.snapshot.stats = stats
        self._load_costs.report(replica_id, stats.host_load_token_cost)
        for request in finished:
            booking = self._bookings.get(request.request_id)
            if booking is None or booking.replica_id != replica_id:
                continue  # routed without asking us (fallback), or already forgotten
            self.release(request.request_id)
            if booking.session_id is not None:
                self._sessions.park(booking.session_id, replica_id, booking.session_turn, booking.num_computed_tokens,
                                    now)
            if request.num_cached_tokens is not None:
                replica.snapshot.predicted_cached_tokens += booking.num_prompt_tokens - booking.num_computed_tokens
                replica.snapshot.actual_cached_tokens += request.num_cached_tokens
        return replica

    def _replica(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Replica(PreemptionWindow(self.config.preemption_window_s))
        return replica
