"""Waiting queues: strict FCFS (a deque), a heap on (priority, arrival_time, request_id), or FCFS with
pinned programs' turns first (continuum)."""
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
    """FCFS, except that turns of programs whose blocks are pinned go first: the pin holds their
    history now, and may expire or be released if they wait."""

    def __init__(self, is_pinned: Callable[[str | None], bool]):
        super().__init__()
        self._is_pinned = is_pinned

    def peek(self) -> Request:
        return next((request for request in self._queue if self._is_pinned(request.session_id)), self._queue[0])

    def pop(self) -> Request:
        request = self.peek()
        self._queue.remove(request)
        return request
