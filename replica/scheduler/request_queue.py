"""Waiting queues: strict FCFS (a deque), a heap on (priority, arrival_time, request_id), or continuum's order
(pinned programs' turns first, then program-level FCFS)."""
import heapq
from collections import deque
from collections.abc import Callable, Iterator

from replica.request import Request


class FCFSRequestQueue:
    def __init__(self):
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request goes back to the head: it has waited once already."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest (priority, arrival_time, request_id) first; Request defines that order."""

    def __init__(self):
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend = add  # a preempted request keeps its place by priority

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


class ContinuumRequestQueue(FCFSRequestQueue):
    """The waiting request that rank orders first goes first (PinKeeper.rank: turns that waited too long, pinned
    programs' turns, then program-level FCFS); equal ranks keep their order in the queue."""

    def __init__(self, rank: Callable[[Request], tuple]):
        super().__init__()
        self._rank = rank
        self._head: Request | None = None  # what peek found: rank moves with the clock, pop takes what was seen

    def add(self, request: Request) -> None:
        self._head = None
        super().add(request)

    def prepend(self, request: Request) -> None:
        self._head = None
        super().prepend(request)

    def peek(self) -> Request:
        self._head = min(self._queue, key=self._rank)
        return self._head

    def pop(self) -> Request:
        request = self._head or self.peek()
        self.remove(request)
        return request

    def remove(self, request: Request) -> None:
        self._head = None
        super().remove(request)
