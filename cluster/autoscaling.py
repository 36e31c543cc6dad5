"""Preemption-driven autoscaling of the engine deployment.

Ray Serve's controller calls `preemption_policy` on every control-loop tick
(about ten times a second) with an `AutoscalingContext`. The engine replicas feed
it through `record_autoscaling_stats()`; Serve hands the values over as
`ctx.aggregated_metrics[name][replica_id]`, each the maximum over the look-back
window (see `AutoscalingSettings.to_serve_config`), so a cumulative counter reads
as its latest value and a gauge as its recent peak.

The fleet scales up when it sheds load (preemptions, or a waiting queue) for a
sustained window, and down one replica at a time after a quiet period with no
preemptions, no queue and KV usage low enough for one replica fewer. Between the
two lies a dead band where the policy holds, so a signal that flaps does not
make the fleet flap.
"""

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import prometheus_client
import ray.util.metrics
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat,
                      PositiveInt, field_validator, model_validator)

from replica.async_engine import ReplicaStats

POLICY_IMPORT_PATH = "cluster.autoscaling:preemption_policy"
# Replicas record their stats every METRICS_INTERVAL_S and push them as often (the field is
# deprecated in Ray 2.60 but still what sets the replicas' push period); every aggregated
# value covers the last LOOK_BACK_PERIOD_S.
METRICS_INTERVAL_S = 1.0
LOOK_BACK_PERIOD_S = 3.0
STATE_KEY = "preemption_policy"

# A child of Serve's logger, so that decisions land in the controller's log.
logger = logging.getLogger("ray.serve.prefixserve.autoscaling")


class DecisionMetrics:
    """The policy's decisions as metrics, in this process's prometheus_client registry and in
    Ray's metrics (exported by every node's metrics agent with a "ray_" prefix): the policy
    runs in the Serve controller, whose own registry nobody scrapes."""

    def __init__(self) -> None:
        labels = ("deployment", "direction", "reason")
        decisions_doc = ("Decisions of the preemption autoscaling policy, counted when the target "
                         "or the reason changes.")
        target_doc = "Replica count the preemption autoscaling policy last asked for."
        self.decisions = prometheus_client.Counter(
            "prefixserve:autoscaling_decisions", decisions_doc, labels)
        self.target_replicas = prometheus_client.Gauge(
            "prefixserve:autoscaling_target_replicas", target_doc, ["deployment"])
        self._ray_decisions = ray.util.metrics.Counter(
            "prefixserve_autoscaling_decisions", decisions_doc, tag_keys=labels)
        self._ray_target_replicas = ray.util.metrics.Gauge(
            "prefixserve_autoscaling_target_replicas", target_doc, tag_keys=("deployment",))

    def set_target(self, deployment: str, target: int) -> None:
        self.target_replicas.labels(deployment).set(target)
        self._ray_target_replicas.set(target, tags={"deployment": deployment})

    def count_decision(self, deployment: str, direction: str, reason: str) -> None:
        self.decisions.labels(deployment, direction, reason).inc()
        self._ray_decisions.inc(tags={"deployment": deployment, "direction": direction, "reason": reason})


@functools.cache
def decision_metrics() -> DecisionMetrics:
    """Created on the first decision, not at import: configs import this module everywhere."""
    return DecisionMetrics()


class PolicyKwargs(BaseModel):
    """Thresholds of `preemption_policy`; every field is a `policy_kwargs` entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preemption_rate_window_s: PositiveFloat = Field(
        5.0, description="Seconds over which the fleet's preemption rate is measured.")
    scale_up_preemption_rate: PositiveFloat = Field(
        0.1, description="Preemptions per second per replica (fleet average) above which the "
                         "fleet is overloaded.")
    scale_up_waiting_requests: PositiveFloat = Field(
        8.0, description="Waiting requests per replica (fleet average) above which the fleet is "
                         "overloaded.")
    scale_up_waiting_tokens: PositiveFloat = Field(
        16384.0, description="Waiting prompt tokens not in any prefix cache, per replica (fleet "
                             "average), above which the fleet is overloaded.")
    upscale_sustain_s: NonNegativeFloat = Field(
        10.0, description="Seconds an overload must last before a scale-up.")
    scale_up_step: PositiveInt = Field(1, description="Replicas added by one scale-up.")
    scale_down_kv_usage: float = Field(
        0.5, gt=0.0, le=1.0,
        description="Scale down only while the fleet's KV usage, spread over one replica fewer, "
                    "stays below this fraction.")
    downscale_quiet_s: NonNegativeFloat = Field(
        120.0, description="Seconds the fleet must be quiet (no preemption, no waiting request, "
                           "KV usage low) before it loses a replica.")


class AutoscalingSettings(BaseModel):
    """Autoscaling of the engine deployment, as `ClusterConfig.autoscaling` holds it."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: PositiveInt = 1
    max_replicas: PositiveInt = 4
    initial_replicas: PositiveInt | None = None
    policy_kwargs: dict[str, Any] = {}

    @field_validator("policy_kwargs")
    @classmethod
    def _known_policy_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        PolicyKwargs.model_validate(value)
        return value

    @model_validator(mode="after")
    def _ordered_bounds(self) -> "AutoscalingSettings":
        initial = self.initial_replicas or self.min_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError("autoscaling needs min_replicas <= initial_replicas <= max_replicas, got "
                             f"{self.min_replicas}, {self.initial_replicas}, {self.max_replicas}")
        return self

    def to_serve_config(self) -> dict[str, Any]:
        """Keyword arguments of `ray.serve.config.AutoscalingConfig` for the engine deployment."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.initial_replicas,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": LOOK_BACK_PERIOD_S,
            "aggregation_function": "max",
            # The policy keeps its own sustain and quiet windows; Serve's delays would stack on them.
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "policy": {
                "policy_function": POLICY_IMPORT_PATH,
                "policy_kwargs": PolicyKwargs.model_validate(self.policy_kwargs).model_dump(),
            },
        }


@dataclass(frozen=True)
class FleetSignals:
    """What the replicas reported, summed over the fleet."""

    preemptions: dict[str, float]  # cumulative count per replica (unique id)
    kv_cache_usage: float          # sum of the replicas' usage fractions
    num_waiting: float
    num_waiting_uncached_tokens: float

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Mapping[Any, float]]) -> "FleetSignals":
        """metrics: Serve's aggregated_metrics, ReplicaStats field -> replica id -> value."""
        replicas = {rid.unique_id: ReplicaStats(**{f.name: metrics.get(f.name, {}).get(rid, 0)
                                                   for f in fields(ReplicaStats)})
                    for rid in metrics.get("num_preemptions", {})}
        return cls(
            preemptions={rid: stats.num_preemptions for rid, stats in replicas.items()},
            kv_cache_usage=sum(stats.kv_cache_usage for stats in replicas.values()),
            num_waiting=sum(stats.num_waiting for stats in replicas.values()),
            num_waiting_uncached_tokens=sum(stats.num_waiting_uncached_tokens for stats in replicas.values()),
        )

    @property
    def num_replicas(self) -> int:
        return len(self.preemptions)


@dataclass
class PolicyState:
    """What the policy remembers between ticks (kept in Serve's `policy_state`)."""

    preemptions: dict[str, float]          # last cumulative count seen per replica
    window_start: float | None = None
    window_preemptions: float = 0.0
    preemption_rate: float = 0.0           # per replica per second, over the last full window
    new_preemptions: float = 0.0           # since the previous tick
    overloaded_since: float | None = None
    quiet_since: float | None = None
    last_target: int | None = None        # the previous tick's decision, to log only changes
    last_reason: str | None = None

    @classmethod
    def load(cls, policy_state: Mapping[str, Any]) -> "PolicyState":
        saved = policy_state.get(STATE_KEY)
        return cls(**saved) if saved else cls(preemptions={})

    def observe(self, signals: FleetSignals, now: float, kwargs: PolicyKwargs) -> None:
        """Fold one tick's signals into the preemption rate."""
        # A replica seen for the first time sets its baseline: its past preemptions are not news.
        self.new_preemptions = sum(max(0.0, count - self.preemptions.get(rid, count))
                                   for rid, count in signals.preemptions.items())
        self.preemptions = dict(signals.preemptions)
        if self.window_start is None:
            self.window_start = now
        self.window_preemptions += self.new_preemptions
        elapsed = now - self.window_start
        if elapsed >= kwargs.preemption_rate_window_s:
            self.preemption_rate = self.window_preemptions / elapsed / max(1, signals.num_replicas)
            self.window_start, self.window_preemptions = now, 0.0

    def overloaded_for(self, now: float) -> float:
        if self.overloaded_since is None:
            self.overloaded_since = now
        return now - self.overloaded_since

    def quiet_for(self, now: float) -> float:
        if self.quiet_since is None:
            self.quiet_since = now
        return now - self.quiet_since

    def reset_timers(self) -> None:
        self.overloaded_since = self.quiet_since = None


def preemption_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve custom autoscaling policy: (AutoscalingContext) -> (target replicas, policy state)."""
    # Serve pickles the policy function by value with the globals it reaches, and metrics hold
    # locks; importing the installed module when called keeps them out of the pickle.
    from cluster.autoscaling import _preemption_policy

    return _preemption_policy(ctx)


def _preemption_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    # Serve passes policy_kwargs only to class policies; a function finds them in the config.
    kwargs = PolicyKwargs.model_validate(ctx.config.policy.policy_kwargs)
    now = ctx.current_time if ctx.current_time is not None else time.time()
    signals = FleetSignals.from_metrics(ctx.aggregated_metrics or {})
    state = PolicyState.load(ctx.policy_state)
    state.observe(signals, now, kwargs)
    target, reason = _decide(ctx, state, signals, kwargs, now)
    _report(ctx, state, signals, target, reason)
    return target, {STATE_KEY: asdict(state)}


def _decide(ctx: Any, state: PolicyState, signals: FleetSignals, kwargs: PolicyKwargs,
            now: float) -> tuple[int, str]:
    lowest, highest = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    current = ctx.target_num_replicas
    if current < lowest or current > highest:
        state.reset_timers()
        return min(max(current, lowest), highest), "bounds"
    if ctx.current_num_replicas != current:
        state.reset_timers()
        return current, "scaling_in_progress"
    if signals.num_replicas == 0:
        state.reset_timers()
        return current, "no_metrics"
    overload = _overload_reason(state, signals, kwargs)
    if overload is not None:
        state.quiet_since = None
        if state.overloaded_for(now) < kwargs.upscale_sustain_s:
            return current, "overload_pending"
        if current >= highest:
            return current, "at_max"
        state.reset_timers()
        return min(current + kwargs.scale_up_step, highest), overload
    state.overloaded_since = None
    if not _is_quiet(state, signals, kwargs, current):
        state.quiet_since = None
        return current, "steady"
    if state.quiet_for(now) < kwargs.downscale_quiet_s:
        return current, "quiet_pending"
    if current <= lowest:
        return current, "at_min"
    state.reset_timers()
    return current - 1, "idle"


def _overload_reason(state: PolicyState, signals: FleetSignals, kwargs: PolicyKwargs) -> str | None:
    replicas = signals.num_replicas
    if state.preemption_rate > kwargs.scale_up_preemption_rate:
        return "preemptions"
    if signals.num_waiting / replicas > kwargs.scale_up_waiting_requests:
        return "waiting_requests"
    if signals.num_waiting_uncached_tokens / replicas > kwargs.scale_up_waiting_tokens:
        return "waiting_tokens"
    return None


def _is_quiet(state: PolicyState, signals: FleetSignals, kwargs: PolicyKwargs, current: int) -> bool:
    usage_on_fewer = signals.kv_cache_usage / max(1, current - 1)
    return (state.new_preemptions == 0 and signals.num_waiting == 0
            and usage_on_fewer < kwargs.scale_down_kv_usage)


def _report(ctx: Any, state: PolicyState, signals: FleetSignals, target: int, reason: str) -> None:
    if (state.last_target, state.last_reason) == (target, reason):
        return
    state.last_target, state.last_reason = target, reason
    deployment = ctx.deployment_name
    metrics = decision_metrics()
    metrics.set_target(deployment, target)
    current = ctx.target_num_replicas
    direction = "up" if target > current else "down" if target < current else "hold"
    change = f"{current} -> {target}" if target != current else f"at {target}"
    metrics.count_decision(deployment, direction, reason)
    level = logging.DEBUG if direction == "hold" else logging.INFO
    logger.log(level, "autoscaling %s: %s %s replicas (%s); preemption rate %.3g/s per replica, %d waiting, "
               "%d waiting uncached tokens, KV usage sum %.2f", deployment, direction, change, reason,
               state.preemption_rate, signals.num_waiting, signals.num_waiting_uncached_tokens,
               signals.kv_cache_usage)
