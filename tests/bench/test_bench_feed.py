"""benchmarks/bench_feed.py on a few engines for a short while: the follower ends with the engines' caches."""
from benchmarks import bench_feed


def test_a_follower_fed_through_pickle_ends_with_what_a_router_applying_the_batches_alone_has():
    row = bench_feed.run(engines=3, steps_per_s=10, seconds=0.5, sync_interval_s=0.1, stores_per_step=2)
    assert row["blocks"] == {f"engine-{e}": (10, 10) for e in range(3)}  # 5 steps storing 2 blocks each
