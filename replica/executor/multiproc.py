"""MultiprocExecutor: the tensor-parallel ranks of an engine as processes of this machine (the offline engine,
and CI's gloo runs); the Ray Serve app places them as Ray actors instead (cluster/tp_workers.py).

Every step goes to every rank over a pipe; the driver rank answers. A rank that dies (or fails, which ends
its process) would leave the others waiting in a collective, so the engine waits on every process too and
raises WorkerLost as soon as one is gone.
"""
import multiprocessing
import os
import socket
from multiprocessing.connection import Connection, wait

import torch

from replica.executor.parallel import TensorParallel
from replica.executor.worker import RunnerSpec, Worker, WorkerLost
from replica.scheduler import ModelRunnerOutput, SchedulerOutput

LOOPBACK = "127.0.0.1"
_SHUTDOWN_TIMEOUT_S = 5.0
_EXIT_WAIT_S = 1.0


class MultiprocExecutor:
    def __init__(self, spec: RunnerSpec, size: int):
        context = multiprocessing.get_context("spawn")  # a forked torch (threads, CUDA) is not safe to use
        master = (LOOPBACK, _free_port())
        self._pipes: list[Connection] = []
        self._processes: list[multiprocessing.Process] = []
        for rank in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, spec, TensorParallel(rank, size), master),
                                      name=f"tp-rank-{rank}", daemon=True)
            process.start()
            theirs.close()
            self._pipes.append(ours)
            self._processes.append(process)
        for pipe in self._pipes:
            self._receive(pipe)  # each rank's "ready"

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for pipe in self._pipes:
            try:
                pipe.send(scheduler_output)
            except (BrokenPipeError, ConnectionResetError):
                raise self._lost() from None
        return self._receive(self._pipes[0])

    def check_health(self) -> None:
        if any(not process.is_alive() for process in self._processes):
            raise self._lost()

    def shutdown(self) -> None:
        # with a rank gone, the others may be waiting for it in a collective: no use asking them to stop
        healthy = all(process.is_alive() for process in self._processes)
        if healthy:
            for pipe in self._pipes:
                pipe.send(None)
        for process in self._processes:
            process.join(_SHUTDOWN_TIMEOUT_S if healthy else 0)
            if process.is_alive():
                process.kill()
                process.join()

    def _receive(self, pipe: Connection):
        ready = wait([pipe, *(process.sentinel for process in self._processes)])
        if pipe not in ready:
            raise self._lost()
        try:
            return pipe.recv()
        except EOFError:
            raise self._lost() from None

    def _lost(self) -> WorkerLost:
        wait([process.sentinel for process in self._processes], timeout=_EXIT_WAIT_S)  # a closed pipe's process ends
        dead = {rank: process.exitcode for rank, process in enumerate(self._processes) if not process.is_alive()}
        return WorkerLost(f"tensor-parallel ranks exited (rank: exit code): {dead}")


def _serve(pipe: Connection, spec: RunnerSpec, tp: TensorParallel, master: tuple[str, int]) -> None:
    """A rank's process: build the worker, then execute every step sent until None. An exception ends it."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp.size))  # the ranks share this machine's cores
    worker = Worker(spec, tp, master, LOOPBACK, local_gpu=tp.rank)
    pipe.send("ready")
    while (scheduler_output := pipe.recv()) is not None:
        output = worker.execute_model(scheduler_output)
        if tp.is_driver:
            pipe.send(output)
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]
