"""RouterClient on a real Ray cluster: the process that creates the router actor keeps it alive when it
looks it up again, for a second channel or after a reset (Ray ends an actor once its creator drops its
first handle)."""
import asyncio
import gc

import pytest
import ray

from cluster.local_ray import init_local_ray
from router.actor import NAMESPACE, RouterClient, router_actor_name
from router.policy import PolicyConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_ray():
    init_local_ray(1)
    yield
    ray.shutdown()


def the_actor():
    return ray.get_actor(router_actor_name("client-test", PolicyConfig(), 16), namespace=NAMESPACE)


def test_the_creator_keeps_the_router_actor_through_other_channels_and_a_reset(local_ray):
    client = RouterClient("client-test", PolicyConfig(), 16)

    async def test():
        first = await client.get()
        actor_id = the_actor()._actor_id
        await client.get("bookings")
        client.reset()
        again = await client.get()
        gc.collect()
        await asyncio.sleep(1)
        update = await again.call("follow", "a follower", None, 0, [])
        return first is not again, update.states, actor_id

    reconnected, states, actor_id = asyncio.run(test())
    assert (reconnected, states) == (True, [])
    assert the_actor()._actor_id == actor_id
