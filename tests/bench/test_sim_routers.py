"""The simulator's K routers (ClusterSpec.num_routers) on tiny workloads: exact decisions; the verdict over seeds."""
import argparse

import pytest
from cluster.config import SEVERAL_ROUTERS_CHOICE_TEMPERATURE_TOKENS
from router import PolicyConfig

from benchmarks.sim.experiment import ClusterSpec, simulate
from benchmarks.sim.report import RunMetrics, routers_verdict
from benchmarks.sim.workloads import Program, Turn, assign_starts, make_workload
from benchmarks.sim_cluster import policy_config

from .test_sim import STEP_MODEL

SPEC = ClusterSpec(num_blocks=1024)
# system_prompts() routed by one router before the simulator had K routers (commit e2ecf0f), and before the
# router priced the memory a request takes (BEFORE_MEMORY_TERM); a publish lag of 30 ms instead of 10 would change them
ONE_ROUTER_REPLICAS = "01232233331200311223303330111223"
ONE_ROUTER_CACHED_TOKENS = 45072
ONE_ROUTER_TTFT_SUM_S = 11.400552155142995
BEFORE_MEMORY_TERM = PolicyConfig(occupancy_weight=0.0)


def routed(programs: list[Program], num_replicas: int, spec: ClusterSpec,
           config: PolicyConfig | None = None) -> tuple[str, int, float]:
    """The replica of every turn in arrival order, the cached prompt tokens and the sum of TTFTs."""
    records, _ = simulate(programs, num_replicas, "prefix", STEP_MODEL, spec, seed=0, config=config)
    records.sort(key=lambda record: record.arrival_s)
    return ("".join(record.replica_id.removeprefix("r") for record in records),
            sum(record.num_cached_tokens for record in records),
            sum(record.first_token_s - record.arrival_s for record in records))


def system_prompts() -> list[Program]:
    programs = make_workload("system-prompts", seed=1, num_replicas=4, num_requests=32)
    assign_starts(programs, requests_per_s=20.0, seed=1)
    return programs


def unrelated_prompts(count: int, apart_s: float) -> list[Program]:
    """Prompts of 64 tokens with nothing in common, arriving apart_s apart."""
    return [Program(f"p{i}", [Turn(list(range(1000 * i, 1000 * i + 64)), [1, 2])], start_s=apart_s * i)
            for i in range(count)]


def test_one_router_routes_as_before_the_simulator_had_several():
    assert routed(system_prompts(), 4, SPEC, BEFORE_MEMORY_TERM) == (ONE_ROUTER_REPLICAS, ONE_ROUTER_CACHED_TOKENS,
                                                                     ONE_ROUTER_TTFT_SUM_S)


@pytest.mark.parametrize("num_routers", [2, 4])
def test_routers_that_learn_everything_at_once_route_as_one(num_routers):
    spec = ClusterSpec(num_blocks=1024, num_routers=num_routers, sync_delay_s=0.0)
    assert routed(system_prompts(), 4, spec) == routed(system_prompts(), 4, SPEC)


@pytest.mark.parametrize("num_routers, sync_delay_s, shared_bookings, replicas", [
    (1, 0.0, True, "0101"),  # each no-hit turn goes where fewer are booked
    (2, 0.0, True, "0101"),  # each router sees the other's booking at once
    (2, 0.0, False, "0011"),  # each router alternates over its own bookings only
    (2, 0.02, True, "0011"),  # the other's booking comes after the burst
])
def test_a_burst_spreads_over_the_bookings_each_router_knows(num_routers, sync_delay_s, shared_bookings, replicas):
    spec = ClusterSpec(num_blocks=1024, num_routers=num_routers, sync_delay_s=sync_delay_s,
                       shared_bookings=shared_bookings)
    assert routed(unrelated_prompts(4, apart_s=0.001), 2, spec)[0] == replicas  # before any replica reports


@pytest.mark.parametrize("booking_delay_s, replicas", [
    (None, "0011"),  # as late as the publications: the other's booking comes after the burst
    (0.0, "0101"),  # at once, though publications still take the sync delay
])
def test_bookings_may_reach_the_other_routers_sooner_than_publications(booking_delay_s, replicas):
    spec = ClusterSpec(num_blocks=1024, num_routers=2, sync_delay_s=0.02, booking_delay_s=booking_delay_s)
    assert routed(unrelated_prompts(4, apart_s=0.001), 2, spec)[0] == replicas


@pytest.mark.parametrize("sync_delay_s, replicas", [
    (0.0, "01"),  # the second router knows r0 caches the first prompt: a new prefix goes where fewer are cached
    (1.0, "00"),  # it has heard nothing yet: both replicas look alike, the first wins the tie
])
def test_publications_reach_every_router_the_sync_delay_later(sync_delay_s, replicas):
    spec = ClusterSpec(num_blocks=1024, num_routers=2, sync_delay_s=sync_delay_s, shared_bookings=False)
    assert routed(unrelated_prompts(2, apart_s=0.5), 2, spec)[0] == replicas


def metrics(seed: int, num_routers: int, shared: bool, hit_rate: float, ttft_p50: float, ttft_p99: float) -> RunMetrics:
    return RunMetrics("agents", 16, "prefix", 100, hit_rate, ttft_p50, 0.0, ttft_p99, 0.0, 0.0, 1.0, 0, 0.0, 0.0, 0.0,
                      num_routers, shared, seed)


def test_the_routers_verdict_over_seeds_takes_mean_points_and_geometric_mean_ratios():
    runs = [metrics(seed, 1, True, 0.8, 1.0, 2.0) for seed in (0, 1)] + [
        metrics(0, 4, True, 0.794, 1.21, 2.0), metrics(1, 4, True, 0.8, 0.9, 2.0),  # p50: 1.21x and 0.9x
        metrics(0, 4, False, 0.8, 1.0, 2.3), metrics(1, 4, False, 0.8, 1.0, 2.16)]  # p99: 1.15x and 1.08x
    assert routers_verdict(runs)[2:] == [
        "| agents | 16 | prefix | shared | 0, 1 | -0.3 | 1.04x | 1.00x | yes | 1 of 2 |",
        "| agents | 16 | prefix | unshared | 0, 1 | +0.0 | 1.00x | 1.11x | **no** | 1 of 2 |"]


def test_with_the_cluster_choice_temperature_several_routers_draw_as_several_ingress_replicas():
    args = argparse.Namespace(cluster_choice_temperature=True, policy_config=PolicyConfig(request_cost_tokens=64))
    one, four = policy_config(args, 1), policy_config(args, 4)
    assert (one.choice_temperature_tokens, four.choice_temperature_tokens) == (
        0.0, SEVERAL_ROUTERS_CHOICE_TEMPERATURE_TOKENS)
    assert one.request_cost_tokens == four.request_cost_tokens == 64
