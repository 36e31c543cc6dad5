"""Executor failures that callers without torch (the ingress) tell apart."""


class WorkerLost(RuntimeError):
    """A tensor-parallel worker of the engine died: the engine cannot step again, and its requests may go on
    on another engine."""
