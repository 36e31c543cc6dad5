"""PoolPuller without Ray: the router's answer comes from a fake feed connection, the blocks from a real PoolServer
(or a port that fails) on loopback, into a real pool file."""
import asyncio
import socket

from cluster import pulls as pulls_module
from cluster.pulls import PoolPuller
from replica.async_engine import EngineRequest
from replica.kv_cache.pool_transfer import PoolServer
from replica.request import SamplingParams
from router.messages import PullSource
from tests.replica.test_host_pool import CHAIN, fill
from tests.replica.test_pool_transfer import node_pool

from .fakes import FakeRouterClient

BLOCK_SIZE = 4
REQUEST = EngineRequest("r1", list(range(4 * len(CHAIN))), CHAIN, SamplingParams(max_tokens=1))


class FakeRouterFeed:
    """Answers every pull_source with the same source, and whether other nodes serve pools as told."""

    def __init__(self, source: PullSource | None, pools_elsewhere: bool = True):
        self.source = source
        self.pools_elsewhere = pools_elsewhere
        self.calls = []

    async def call(self, method: str, *args):
        self.calls.append((method, *args))
        return self.pools_elsewhere if method == "pools_elsewhere" else self.source


def puller(tmp_path, feed: FakeRouterFeed, timeout_s: float = 5.0) -> tuple[PoolPuller, FakeRouterClient]:
    client = FakeRouterClient(feed)
    return PoolPuller("b", node_pool(tmp_path, "b").spec, client, BLOCK_SIZE, timeout_s), client


def test_a_request_pulls_the_blocks_the_router_names_and_measures_the_pull(tmp_path):
    async def test():
        source = node_pool(tmp_path, "a")
        fill(source, CHAIN[:4], [1, 2, 3, 4])
        server = PoolServer(source)
        address = server.start("127.0.0.1")
        feed = FakeRouterFeed(PullSource(address, 1, 3))
        pulls, _ = puller(tmp_path, feed)
        assert pulls.seconds_per_token() is None
        await pulls.pull_for(REQUEST)
        await pulls.pull_for(REQUEST)
        server.close()
        return pulls, feed

    pulls, feed = asyncio.run(test())
    assert (pulls.num_pulled_tokens, pulls.num_failures) == (2 * 3 * BLOCK_SIZE, 0)
    assert node_pool(tmp_path, "b").contents() == set(CHAIN[1:4])
    # pools elsewhere asked once: the answer holds POOLS_CHECK_INTERVAL_S
    assert feed.calls == [("pools_elsewhere", "b"), ("pull_source", "b", CHAIN), ("pull_source", "b", CHAIN)]
    assert pulls.seconds_per_token() > 0  # what a pulled token took, for the router's price


def test_a_pull_from_a_pool_that_cannot_be_reached_leaves_the_request_to_compute(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = closed.getsockname()
    pulls, client = puller(tmp_path, FakeRouterFeed(PullSource(address, 0, 2)))
    asyncio.run(pulls.pull_for(REQUEST))  # no exception: the engine computes the blocks
    assert node_pool(tmp_path, "b").contents() == set()
    assert (client.resets, pulls.num_pulled_tokens, pulls.num_failures) == (1, 0, 1)


def test_a_pull_that_takes_too_long_is_given_up(tmp_path):
    async def test():
        async def never_answer(reader, writer):
            await asyncio.sleep(60)
        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        pulls, client = puller(tmp_path, FakeRouterFeed(PullSource(server.sockets[0].getsockname()[:2], 0, 2)),
                               timeout_s=0.2)
        await asyncio.wait_for(pulls.pull_for(REQUEST), 5)
        server.close()
        return client

    client = asyncio.run(test())
    assert node_pool(tmp_path, "b").contents() == set()
    assert client.resets == 1


def test_where_no_other_node_serves_a_pool_requests_do_not_ask_where_to_pull_from(tmp_path, monkeypatch):
    feed = FakeRouterFeed(PullSource(("127.0.0.1", 1), 0, 2), pools_elsewhere=False)
    pulls, _ = puller(tmp_path, feed)
    asyncio.run(pulls.pull_for(REQUEST))
    asyncio.run(pulls.pull_for(REQUEST))
    assert feed.calls == [("pools_elsewhere", "b")]
    monkeypatch.setattr(pulls_module, "POOLS_CHECK_INTERVAL_S", 0.0)  # the next request asks again
    feed.pools_elsewhere = True
    feed.source = None
    asyncio.run(pulls.pull_for(REQUEST))
    assert feed.calls[1:] == [("pools_elsewhere", "b"), ("pull_source", "b", CHAIN)]
    assert (pulls.num_pulled_tokens, pulls.num_failures) == (0, 0)
