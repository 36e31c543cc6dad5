import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import ray
from prometheus_client import REGISTRY
from ray import serve
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.autoscaling import (LOOK_BACK_PERIOD_S, METRICS_INTERVAL_S, POLICY_IMPORT_PATH,
                                 AutoscalingSettings, PolicyKwargs, logger, preemption_policy)
from cluster.local_ray import init_local_ray

DEPLOYMENT = DeploymentID(name="Engine", app_name="prefixserve")
# Short windows so that the expected sequences stay readable: one tick per second.
KWARGS = dict(preemption_rate_window_s=2.0, scale_up_preemption_rate=0.5, scale_up_waiting_requests=4.0,
              scale_up_waiting_tokens=1000.0, upscale_sustain_s=3.0, scale_down_kv_usage=0.5,
              downscale_quiet_s=5.0)


@dataclass(frozen=True)
class Load:
    """What one replica reports for one second."""
    preemptions: int = 0  # new in this second
    kv_usage: float = 0.1
    waiting: int = 0
    waiting_tokens: int = 0


IDLE = Load()
OVERLOADED = Load(preemptions=2, kv_usage=0.95, waiting=10, waiting_tokens=5000)


def autoscaling_config(settings: AutoscalingSettings) -> AutoscalingConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # metrics_interval_s, on purpose
        return AutoscalingConfig(**settings.to_serve_config())


class FakeFleet:
    """Engine replicas as the Serve controller sees them, one control-loop tick per second.

    A replica starts or stops `startup_s` seconds after the policy changes the target; every
    replica reports `load(second, replica_index)` through real `AutoscalingContext`s."""

    def __init__(self, settings: AutoscalingSettings, load: Callable[[int, int], Load], *,
                 startup_s: int = 2, policy=preemption_policy):
        self.config = autoscaling_config(settings)
        self.load, self.startup_s, self.policy = load, startup_s, policy
        self.target = settings.initial_replicas or settings.min_replicas
        self.num_started = 0
        self.replicas = [self._new_replica() for _ in range(self.target)]
        self.preemptions: dict[ReplicaID, int] = {r: 0 for r in self.replicas}
        self.policy_state: dict = {}
        self.settle_at = 0

    def _new_replica(self) -> ReplicaID:
        self.num_started += 1
        return ReplicaID(unique_id=f"r{self.num_started}", deployment_id=DEPLOYMENT)

    def run(self, seconds: int) -> list[int]:
        return [self.tick(now) for now in range(seconds)]

    def tick(self, now: int) -> int:
        if now >= self.settle_at:
            self._settle()
        target, self.policy_state = self.policy(self.context(now))
        if target != self.target:
            self.target, self.settle_at = target, now + self.startup_s
        return target

    def _settle(self) -> None:
        while len(self.replicas) < self.target:
            self.replicas.append(self._new_replica())
            self.preemptions[self.replicas[-1]] = 0
        del self.replicas[self.target:]

    def context(self, now: int) -> AutoscalingContext:
        loads = {r: self.load(now, i) for i, r in enumerate(self.replicas)}
        for replica, load in loads.items():
            self.preemptions[replica] += load.preemptions
        metrics = {
            "num_preemptions": {r: float(self.preemptions[r]) for r in loads},
            "kv_cache_usage": {r: load.kv_usage for r, load in loads.items()},
            "num_waiting": {r: float(load.waiting) for r, load in loads.items()},
            "num_waiting_uncached_tokens": {r: float(load.waiting_tokens) for r, load in loads.items()},
        }
        return AutoscalingContext(
            deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
            current_num_replicas=len(self.replicas), target_num_replicas=self.target,
            running_replicas=list(self.replicas), total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics=metrics, raw_metrics={},
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=dict(self.policy_state), last_scale_up_time=None, last_scale_down_time=None,
            current_time=float(now), config=self.config)


@pytest.fixture
def policy_log(caplog):
    # Serve's logger, the policy logger's parent, does not propagate to the root logger.
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def settings(min_replicas=1, max_replicas=3, initial_replicas=None, **kwargs) -> AutoscalingSettings:
    return AutoscalingSettings(min_replicas=min_replicas, max_replicas=max_replicas,
                               initial_replicas=initial_replicas, policy_kwargs={**KWARGS, **kwargs})


def test_sustained_overload_adds_one_replica_per_sustain_window_up_to_max():
    fleet = FakeFleet(settings(), lambda now, i: OVERLOADED)
    # Overloaded from t=0; at t=3 the 3 s sustain window is full -> 2. The new replica runs at
    # t=5, the window restarts there -> 3 at t=8, running at t=10; then held at max.
    assert fleet.run(16) == [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]


def test_burst_shorter_than_the_sustain_window_does_not_scale_up():
    def burst(now, i):
        return Load(preemptions=4, kv_usage=0.9, waiting=3) if now in (1, 2) else IDLE

    fleet = FakeFleet(settings(initial_replicas=2), burst)
    # Preemption rate over [0, 2] is 4/s per replica: overloaded at t=2 and t=3 only, as the
    # window [2, 4] has none. Quiet from t=4 (two replicas at 0.1 fit in one at 0.2), so
    # after 5 quiet seconds, at t=9, the fleet shrinks to the minimum.
    assert fleet.run(14) == [2] * 9 + [1] * 5


def test_quiet_period_removes_one_replica_per_quiet_window_down_to_min():
    fleet = FakeFleet(settings(initial_replicas=3), lambda now, i: IDLE)
    assert fleet.run(22) == [3] * 5 + [2] * 7 + [1] * 10


def test_kv_usage_that_would_not_fit_in_one_replica_fewer_holds_the_fleet():
    fleet = FakeFleet(settings(initial_replicas=2), lambda now, i: Load(kv_usage=0.3))
    assert fleet.run(12) == [2] * 12  # 0.6 on one replica is above scale_down_kv_usage 0.5


def test_flapping_signal_neither_scales_up_nor_down():
    def flapping(now, i):
        return Load(waiting=10, kv_usage=0.2) if now % 4 < 2 else Load(kv_usage=0.2)

    # Overloads last 2 s (sustain 3 s) and quiet spells 2 s (quiet 5 s): hold throughout.
    fleet = FakeFleet(settings(initial_replicas=2), flapping)
    assert fleet.run(24) == [2] * 24


@pytest.mark.parametrize("load, reason, targets", [
    # The first preemption rate is known at t=2, when the first 2 s window closes.
    (Load(preemptions=2), "preemptions", [1, 1, 1, 1, 1, 2]),
    (Load(waiting=5), "waiting_requests", [1, 1, 1, 2, 2, 2]),
    (Load(waiting_tokens=1001), "waiting_tokens", [1, 1, 1, 2, 2, 2]),
])
def test_each_overload_signal_scales_up_on_its_own(load, reason, targets, policy_log):
    assert FakeFleet(settings(), lambda now, i: load).run(6) == targets
    assert f"Engine: up 1 -> 2 replicas ({reason})" in policy_log.text


def test_scale_up_step_is_clamped_to_max():
    fleet = FakeFleet(settings(initial_replicas=2, max_replicas=4, scale_up_step=3),
                      lambda now, i: OVERLOADED)
    assert fleet.run(5) == [2, 2, 2, 4, 4]


def test_target_outside_the_bounds_is_clamped_at_once():
    fleet = FakeFleet(settings(initial_replicas=3), lambda now, i: OVERLOADED)
    fleet.config = autoscaling_config(settings(max_replicas=2))   # max lowered under a running fleet
    assert fleet.tick(0) == 2
    fleet.config = autoscaling_config(settings(min_replicas=3, max_replicas=4))
    fleet.target = 1
    assert fleet.tick(1) == 3


def test_no_metrics_yet_holds():
    fleet = FakeFleet(settings(initial_replicas=2), lambda now, i: IDLE)
    context = fleet.context(0)
    context.aggregated_metrics.clear()
    assert preemption_policy(context)[0] == 2


def test_serve_runs_the_pickled_policy_with_the_same_decisions():
    config = autoscaling_config(settings())
    # What Serve's controller calls: the unpickled function wrapped with the config's delays.
    serve_policy = _apply_autoscaling_config(config.policy.get_policy())
    fleet = FakeFleet(settings(), lambda now, i: OVERLOADED, policy=serve_policy)
    assert fleet.run(9) == [1, 1, 1, 2, 2, 2, 2, 2, 3]


def test_decisions_are_counted_by_reason():
    def count():
        labels = {"deployment": "Engine", "direction": "down", "reason": "idle"}
        return REGISTRY.get_sample_value("prefixserve:autoscaling_decisions_total", labels) or 0.0

    before = count()
    FakeFleet(settings(initial_replicas=3), lambda now, i: IDLE).run(13)
    assert count() - before == 2.0
    assert REGISTRY.get_sample_value("prefixserve:autoscaling_target_replicas",
                                     {"deployment": "Engine"}) == 1.0


def test_to_serve_config_is_a_valid_autoscaling_config():
    serve_config = settings(initial_replicas=2, scale_up_step=2).to_serve_config()
    assert serve_config == {
        "min_replicas": 1, "max_replicas": 3, "initial_replicas": 2,
        "metrics_interval_s": METRICS_INTERVAL_S, "look_back_period_s": LOOK_BACK_PERIOD_S,
        "aggregation_function": "max", "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
        "policy": {"policy_function": POLICY_IMPORT_PATH,
                   "policy_kwargs": PolicyKwargs(**KWARGS, scale_up_step=2).model_dump()},
    }
    assert set(serve_config) <= set(AutoscalingConfig.model_fields)
    config = autoscaling_config(settings(initial_replicas=2))
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 3, 2)
    assert config.policy.policy_kwargs["upscale_sustain_s"] == 3.0


def test_policy_kwargs_default_to_documented_values():
    kwargs = AutoscalingSettings().to_serve_config()["policy"]["policy_kwargs"]
    assert kwargs == PolicyKwargs().model_dump()
    assert all(field.description for field in PolicyKwargs.model_fields.values())


@pytest.mark.parametrize("bad", [
    dict(policy_kwargs={"upscale_sustain": 3.0}),        # unknown key (typo)
    dict(policy_kwargs={"scale_down_kv_usage": 1.5}),
    dict(policy_kwargs={"scale_up_step": 0}),
    dict(min_replicas=3, max_replicas=2),
    dict(min_replicas=2, initial_replicas=1),
    dict(max_replicas=2, initial_replicas=3),
    dict(min_replicas=0),
    dict(max_replica=2),                                # unknown setting
])
def test_bad_settings_raise_value_error(bad):
    with pytest.raises(ValueError):
        AutoscalingSettings(**bad)


class FakeLoadSwitch:
    """What every FakeEngine replica reports as its waiting queue (a Ray actor)."""

    def __init__(self) -> None:
        self.num_waiting = 0

    def set(self, num_waiting: int) -> None:
        self.num_waiting = num_waiting

    def get(self) -> int:
        return self.num_waiting


class FakeEngine:
    """An engine deployment that only reports autoscaling stats."""

    def __init__(self, switch) -> None:
        self.switch = switch

    async def record_autoscaling_stats(self) -> dict[str, float]:
        num_waiting = await self.switch.get.remote()
        return {"num_preemptions": 0.0, "kv_cache_usage": 0.1, "num_waiting": float(num_waiting),
                "num_waiting_uncached_tokens": 0.0}

    def __call__(self) -> str:
        return "ok"


def wait_for_replicas(expected: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications["autoscaling"].deployments["FakeEngine"]
        if status.replica_states.get("RUNNING", 0) == expected and sum(status.replica_states.values()) == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"no {expected} running replicas within {timeout_s} s: {status.replica_states}")


@pytest.mark.e2e
@pytest.mark.slow
def test_real_serve_scales_a_fake_engine_up_and_back_down(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    settings = AutoscalingSettings(min_replicas=1, max_replicas=2, policy_kwargs=dict(
        preemption_rate_window_s=1.0, upscale_sustain_s=1.0, downscale_quiet_s=2.0))
    init_local_ray(2)
    try:
        switch = ray.remote(FakeLoadSwitch).options(num_cpus=0).remote()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            deployment = serve.deployment(FakeEngine, ray_actor_options={"num_cpus": 0},
                                          autoscaling_config=settings.to_serve_config())
        serve.run(deployment.bind(switch), name="autoscaling", route_prefix=None)
        wait_for_replicas(1)
        ray.get(switch.set.remote(20))     # 20 waiting per replica > scale_up_waiting_requests 8
        wait_for_replicas(2)
        ray.get(switch.set.remote(0))
        wait_for_replicas(1)
    finally:
        serve.shutdown()
        ray.shutdown()
