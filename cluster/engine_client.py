"""What serving asks of the engines (EngineClient) and the failures, Ray-free, that a client may raise."""
from collections.abc import AsyncGenerator
from typing import Protocol

from replica.async_engine import EngineOutput, EngineRequest


class EnginesBusy(Exception):
    """No engine replica has room, and the ingress's queue for them is full."""

    def __init__(self, retry_after_s: float):
        super().__init__(f"retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ReplicaLost(Exception):
    """The engine replica serving a request died or left the deployment before finishing it."""


class EngineClient(Protocol):
    def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """The request's outputs up to a finished one, the first naming the replica serving it; EnginesBusy
        instead of the first when there is no room for it; ReplicaLost when its replica is gone."""
