"""Prometheus metrics of the whole app, rendered by the ingress at /metrics, one series per replica.

Two sources meet here. The ingress times every request itself (TTFT, inter-token latency,
end-to-end latency, token counts) and labels it with the replica that served it; it also counts
the requests it migrated off a lost replica. The engine
gauges and cache counters, and the router's own series, come from this ingress's routing view, which
the router feed keeps current with every replica's stats; they are read at scrape time.
Names mirror vLLM's (vllm:* -> prefixserve:*) with the same meaning.
"""
import itertools
import operator
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from replica.structured_output.stats import HistogramCounts
from router.messages import RouterSnapshot

PREFIX = "prefixserve:"
# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class RequestTracker:
    """Times one request as the ingress sees it; call observe() with each engine output."""

    def __init__(self, metrics: "ServingMetrics", replica_id: str, arrival_time: float):
        self._metrics = metrics
        self._arrival_time = arrival_time
        self._last_token_time: float | None = None
        self.replica_id = replica_id

    @property
    def replica_id(self) -> str:
        """The replica serving the request now: it changes if the request migrates."""
        return self._replica_id

    @replica_id.setter
    def replica_id(self, replica_id: str) -> None:
        # the series of every token, found once a replica rather than at each token (a lock and a lookup each)
        self._replica_id = replica_id
        self._itl = self._metrics.itl.labels(replica_id)
        self._generation_tokens = self._metrics.generation_tokens.labels(replica_id)

    def observe(self, num_new_tokens: int, num_prompt_tokens: int, finished: bool) -> None:
        now = time.monotonic()
        metrics, replica_id = self._metrics, self._replica_id
        if num_new_tokens:
            if self._last_token_time is None:
                metrics.ttft.labels(replica_id).observe(now - self._arrival_time)
                metrics.prompt_tokens.labels(replica_id).inc(num_prompt_tokens)
            else:
                self._itl.observe(now - self._last_token_time)
            self._last_token_time = now
            self._generation_tokens.inc(num_new_tokens)
        if finished:
            metrics.e2e.labels(replica_id).observe(now - self._arrival_time)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["replica"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive token outputs in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.migrations = Counter(PREFIX + "request_migrations",
                                  "Requests moved to another replica after theirs was lost mid-request.",
                                  registry=self.registry)
        self._router = RouterCollector()
        self.registry.register(self._router)

    def render(self, snapshot: RouterSnapshot | None) -> bytes:
        """Prometheus text; without a snapshot (router unreachable) only the ingress's own series."""
        self._router.snapshot = snapshot
        return generate_latest(self.registry)


# Per-replica series from the router's snapshot: (family, name, the ReplicaSnapshot attribute it reads, help).
REPLICA_SERIES = [
    (GaugeMetricFamily, "num_requests_running", "stats.num_running", "Requests in the engine's running queue."),
    (GaugeMetricFamily, "num_requests_waiting", "stats.num_waiting", "Requests in the engine's waiting queue."),
    (GaugeMetricFamily, "kv_cache_usage_perc", "stats.kv_usage", "KV cache usage (1 = 100%)."),
    (CounterMetricFamily, "num_preemptions", "stats.num_preemptions", "Requests preempted by the engine."),
    (CounterMetricFamily, "prefix_cache_queries", "stats.prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache."),
    (CounterMetricFamily, "prefix_cache_hits", "stats.prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    (CounterMetricFamily, "host_pool_hits", "stats.host_pool_hits",
     "Of those, tokens loaded from the node's KV pool (the second tier) rather than found on the device."),
    (CounterMetricFamily, "pulled_tokens", "stats.pulled_tokens",
     "Prompt tokens the replica pulled from another node's KV pool into its own node's pool."),
    (CounterMetricFamily, "pull_failures", "stats.pull_failures",
     "Pulls that failed or timed out: their requests computed the prefix instead."),
    (GaugeMetricFamily, "pinned_blocks", "stats.pins.num_pinned_blocks",
     "KV blocks held by continuum pins between a program's turns."),
    (CounterMetricFamily, "pins", "stats.pins.pinned",
     "Finished turns whose KV blocks were pinned for the program's next turn."),
    (CounterMetricFamily, "pin_hits", "stats.pins.hits",
     "Next turns admitted while their program's pin held their history."),
    (CounterMetricFamily, "pins_expired", "stats.pins.expired",
     "Pins that ran out of time before the program's next turn."),
    (CounterMetricFamily, "pins_released", "stats.pins.released",
     "Pins released early to give a running request or an admission blocks."),
    (CounterMetricFamily, "next_turn_prefix_cache_queries", "stats.pins.next_turn_queries",
     "Prompt tokens of next turns (their program's previous turn finished here) looked up, continuum."),
    (CounterMetricFamily, "next_turn_prefix_cache_hits", "stats.pins.next_turn_hits",
     "Of those, tokens found in the prefix cache."),
    (CounterMetricFamily, "spec_decode_num_drafts", "stats.spec_decoding.num_drafts",
     "Speculative decoding: request steps that verified draft tokens."),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "stats.spec_decoding.num_draft_tokens",
     "Speculative decoding: draft tokens verified."),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "stats.spec_decoding.num_accepted_tokens",
     "Speculative decoding: draft tokens accepted."),
    (CounterMetricFamily, "structured_output_errors", "stats.structured_outputs.errors",
     "Constrained requests that failed: their constraint did not compile in time, or the output left it."),
    (GaugeMetricFamily, "kv_cached_blocks", "stats.num_cached_blocks",
     "Blocks in the engine's prefix cache, which the router's index mirrors."),
    (GaugeMetricFamily, "router_index_blocks", "index_blocks", "Blocks the router believes the replica caches."),
    (GaugeMetricFamily, "router_index_host_blocks", "index_host_blocks",
     "Blocks the router believes the replica's node pool (the second KV tier) holds."),
    (GaugeMetricFamily, "router_requests_in_flight", "num_in_flight",
     "Requests routed to the replica and not finished."),
    (GaugeMetricFamily, "router_parked_sessions", "num_parked_sessions",
     "Sessions between turns whose last turn the replica served (parked within session_ttl_s)."),
    (CounterMetricFamily, "router_predicted_cached_tokens", "predicted_cached_tokens",
     "Prompt tokens the router expected cached on the replica it chose."),
    (CounterMetricFamily, "router_actual_cached_tokens", "actual_cached_tokens",
     "Prompt tokens the replica actually found cached, for the same requests."),
]


class RouterCollector(Collector):
    """Engine and router series from the snapshot of this ingress's routing view."""

    def __init__(self) -> None:
        self.snapshot: RouterSnapshot | None = None

    def collect(self):
        if self.snapshot is None:
            return
        for family, name, attribute, doc in REPLICA_SERIES:
            metric, value = family(PREFIX + name, doc, labels=["replica"]), operator.attrgetter(attribute)
            for replica_id, replica in sorted(self.snapshot.replicas.items()):
                metric.add_metric([replica_id], value(replica))
            yield metric
        yield self._accepted_per_position()
        yield from self._structured_outputs()
        decisions = CounterMetricFamily(PREFIX + "router_decisions", "Routing decisions by policy and outcome.",
                                        labels=["policy", "outcome"])
        for outcome, count in sorted(self.snapshot.decisions.items()):
            decisions.add_metric([self.snapshot.policy, outcome], count)
        yield decisions

    def _structured_outputs(self):
        replicas = sorted(self.snapshot.replicas.items())
        requests = CounterMetricFamily(PREFIX + "structured_output_requests",
                                       "Requests with a structured-output constraint, by kind.",
                                       labels=["replica", "kind"])
        compile_seconds = HistogramMetricFamily(PREFIX + "grammar_compile_seconds",
                                                "Time to compile a constraint (once per distinct spec).",
                                                labels=["replica"])
        mask_fill_seconds = HistogramMetricFamily(PREFIX + "grammar_mask_fill_seconds",
                                                  "Time to fill one step's token bitmask, while the forward pass ran.",
                                                  labels=["replica"])
        for replica_id, replica in replicas:
            stats = replica.stats.structured_outputs
            for kind, count in sorted(stats.requests.items()):
                requests.add_metric([replica_id, kind], count)
            compile_seconds.add_metric([replica_id], *_buckets(stats.compile_seconds))
            mask_fill_seconds.add_metric([replica_id], *_buckets(stats.mask_fill_seconds))
        return requests, compile_seconds, mask_fill_seconds

    def _accepted_per_position(self) -> CounterMetricFamily:
        metric = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Speculative decoding: draft tokens accepted, by position among the drafts.",
                                     labels=["replica", "position"])
        for replica_id, replica in sorted(self.snapshot.replicas.items()):
            for position, count in enumerate(replica.stats.spec_decoding.num_accepted_tokens_per_pos):
                metric.add_metric([replica_id, str(position)], count)
        return metric


def _buckets(histogram: HistogramCounts) -> tuple[list[tuple[str, int]], float]:
    """Prometheus's cumulative buckets ("le" bounds, "+Inf" last) and the sum."""
    cumulative = itertools.accumulate(histogram.counts)
    bounds = [str(bound) for bound in histogram.bounds] + ["+Inf"]
    return list(zip(bounds, cumulative)), histogram.total
