"""The router feed's wire, on loopback: calls, their errors, the token, and a connection per caller."""
import asyncio
import threading

import pytest

from router.wire import FeedConnection, FeedError, FeedServer


class Target:
    def __init__(self):
        self.calls: list[tuple] = []
        self.released = threading.Event()

    def add(self, a: int, b: int) -> int:
        self.calls.append(("add", a, b))
        return a + b

    def fail(self) -> None:
        raise ValueError("bad batch")

    def hold(self) -> str:
        self.released.wait(timeout=10)
        return "released"

    def secret(self) -> None:
        raise AssertionError("not served: never called")


@pytest.fixture
def served():
    target = Target()
    server = FeedServer(target, frozenset({"add", "fail", "hold"}), "127.0.0.1")
    yield target, server
    target.released.set()
    server.close()


def test_calls_return_the_served_methods_results_in_the_order_sent(served):
    target, server = served

    async def main():
        connection = await FeedConnection.open(server.address, server.token)
        results = [await connection.call("add", n, 10) for n in range(3)]
        connection.close()
        return results

    assert asyncio.run(main()) == [10, 11, 12]
    assert target.calls == [("add", 0, 10), ("add", 1, 10), ("add", 2, 10)]


def test_a_method_that_raises_or_is_not_served_is_a_feed_error_and_the_connection_goes_on(served):
    _, server = served

    async def main():
        connection = await FeedConnection.open(server.address, server.token)
        errors = []
        for method in ("fail", "secret"):
            with pytest.raises(FeedError) as raised:
                await connection.call(method)
            errors.append(str(raised.value))
        return errors, await connection.call("add", 1, 2)

    assert asyncio.run(main()) == (["ValueError('bad batch')", "no method 'secret' here"], 3)


def test_a_caller_without_the_token_is_cut_off_before_anything_runs(served):
    target, server = served

    async def main():
        connection = await FeedConnection.open(server.address, b"x" * 16)
        with pytest.raises(ConnectionError):
            await connection.call("add", 1, 2)
        with pytest.raises(ConnectionError):  # broken for good: the caller opens another
            await connection.call("add", 1, 2)

    asyncio.run(main())
    assert target.calls == []


def test_a_call_held_on_one_connection_does_not_hold_up_another(served):
    target, server = served

    async def main():
        holding = await FeedConnection.open(server.address, server.token)
        other = await FeedConnection.open(server.address, server.token)
        held = asyncio.ensure_future(holding.call("hold"))
        assert await asyncio.wait_for(other.call("add", 2, 2), timeout=5) == 4
        assert not held.done()
        target.released.set()
        return await asyncio.wait_for(held, timeout=5)

    assert asyncio.run(main()) == "released"


def test_a_server_gone_breaks_its_connections():
    server = FeedServer(Target(), frozenset({"add"}), "127.0.0.1")

    async def main():
        connection = await FeedConnection.open(server.address, server.token)
        assert await connection.call("add", 1, 1) == 2
        server.close()
        with pytest.raises(ConnectionError):
            await connection.call("add", 1, 1)
        with pytest.raises(ConnectionError):
            await FeedConnection.open(server.address, server.token)

    asyncio.run(main())
