"""Pulls between nodes: two worker nodes on this machine (test_e2e_multinode's cluster), one engine replica each,
each node with a pool of its own ("{node}" in the pool path, as two machines each have their own /dev/shm).
Round robin sends a prompt's second request to the replica that did not compute it, on the other node: that
replica pulls the prompt's blocks from the first node's pool into its own and loads them from there."""
import pytest

from cluster.config import ClusterConfig
from tests.cluster.test_e2e import BLOCK_SIZE, ENGINE, metric_values, until_equal
from tests.cluster.test_e2e_host_pool import PROMPT, complete
from tests.cluster.test_e2e_multinode import deployment_replicas, three_nodes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    pool = {"host_pool_gib": 0.1, "host_pool_path": str(tmp_path_factory.mktemp("pools") / "kv-{node}")}
    with three_nodes(ClusterConfig(engine=ENGINE | pool, num_replicas=2, routing="round_robin")) as (_, _, url):
        yield url


def test_a_prompt_computed_on_one_node_is_pulled_into_the_other_nodes_pool_and_loaded_there(base_url):
    assert len({node for _, node in deployment_replicas().values()}) == 2  # one replica per worker node
    first, computed = complete(base_url, PROMPT)
    num_prompt_tokens = computed["usage"]["prompt_tokens"]
    num_blocks = (num_prompt_tokens + PROMPT["max_tokens"] - 1) // BLOCK_SIZE
    # the router knows what the first node's pool holds before the prompt comes again
    until_equal(lambda: metric_values(base_url, "router_index_host_blocks").get(first), num_blocks)

    second, pulled = complete(base_url, PROMPT)

    assert first != second
    assert pulled["choices"][0]["text"] == computed["choices"][0]["text"]
    num_loaded = (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert pulled["usage"]["prompt_tokens_details"]["cached_tokens"] == num_loaded
    assert metric_values(base_url, "host_pool_hits_total") == {first: 0.0, second: float(num_loaded)}
    num_pulled = num_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE  # the prompt's full blocks
    assert metric_values(base_url, "pulled_tokens_total") == {first: 0.0, second: float(num_pulled)}
    assert metric_values(base_url, "pull_failures_total") == {first: 0.0, second: 0.0}
    # each node's pool holds the blocks now: the first's computed them, the second's pulled the prompt's and
    # computed the rest
    until_equal(lambda: metric_values(base_url, "router_index_host_blocks"), {first: num_blocks, second: num_blocks})
