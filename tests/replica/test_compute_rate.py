"""ComputeRate: a replica's recent busy seconds per computed token, from the steps the scheduler reports."""
import pytest

from replica.scheduler.compute_rate import ComputeRate, LoadRate

from .scheduler_helpers import FakeClock


def run_step(clock: FakeClock, rate: ComputeRate, num_tokens: int, start: float, end: float) -> None:
    clock.now = start
    rate.step_scheduled(num_tokens)
    clock.now = end
    rate.step_done(num_tokens)


def test_nothing_costs_anything_before_the_first_step():
    assert ComputeRate(FakeClock()).seconds(1000) == 0.0


def test_a_step_prices_its_tokens_and_the_time_between_steps_is_not_counted():
    clock = FakeClock()
    rate = ComputeRate(clock)
    run_step(clock, rate, 8, start=0.0, end=1.0)
    assert rate.seconds(16) == 2.0
    run_step(clock, rate, 4, start=5.0, end=5.25)  # idle from 1.0 to 5.0
    assert rate.seconds(1) == pytest.approx((0.99 * 1.0 + 0.25) / (0.99 * 8 + 4))


def test_steps_in_flight_together_count_their_overlap_once():
    clock = FakeClock()
    rate = ComputeRate(clock)
    rate.step_scheduled(8)  # at 0.0
    clock.now = 0.5
    rate.step_scheduled(8)  # async scheduling: the next step goes while the first computes
    clock.now = 1.0
    rate.step_done(8)
    clock.now = 1.5
    rate.step_done(8)  # 0.5 s of its own, not 1.0
    assert rate.seconds(1) == pytest.approx((0.99 * 1.0 + 0.5) / (0.99 * 8 + 8))


def test_steps_without_tokens_are_not_steps():
    clock = FakeClock()
    rate = ComputeRate(clock)
    rate.step_scheduled(0)
    run_step(clock, rate, 10, start=1.0, end=2.0)
    rate.step_done(0)
    assert rate.seconds(10) == 1.0


def test_a_load_rate_no_load_renews_is_forgotten_and_the_next_load_starts_it_afresh():
    clock = FakeClock()
    rate = LoadRate(clock, max_age_s=60.0)
    assert rate.seconds_per_token() is None
    rate.loaded(100, 0.5)  # slow: pages touched for the first time
    clock.now = 60.0
    assert rate.seconds_per_token() == 0.005
    clock.now = 60.5
    assert rate.seconds_per_token() is None
    rate.loaded(100, 0.01)
    assert rate.seconds_per_token() == 0.0001  # not blended with the forgotten 0.005
