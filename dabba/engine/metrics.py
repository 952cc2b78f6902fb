"""Prometheus metrics of one engine: queue sizes, KV-cache use, prefix-cache hits, preemptions,
speculative decoding's drafts and acceptance, token counters and latency histograms (time to
first token, per output token, end to end)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dabba.core.stats import SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_running = gauge("dabba:num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("dabba:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("dabba:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)")
        self.kv_cache_tokens = gauge("dabba:kv_cache_tokens", "KV-cache slots holding a computed token (shared blocks once)")
        self.kv_cache_slot_utilization = gauge("dabba:kv_cache_slot_utilization",
                                               "Slots holding a token / slots of the blocks in use")
        self.prefix_cache_hit_rate = gauge("dabba:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up")
        self.num_preemptions = counter("dabba:num_preemptions", "Requests preempted (KV blocks ran out)")
        self.prompt_tokens = counter("dabba:prompt_tokens", "Prompt tokens of requests that finished prefill")
        self.generation_tokens = counter("dabba:generation_tokens", "Tokens generated")
        self.time_to_first_token = histogram("dabba:time_to_first_token_seconds", "Arrival to first output token")
        self.time_per_output_token = histogram("dabba:time_per_output_token_seconds", "Mean gap between output tokens of a request")
        self.e2e_request_latency = histogram("dabba:e2e_request_latency_seconds", "Arrival to finish")
        self.spec_num_drafts = counter("dabba:spec_decode_num_drafts", "Speculative steps (a request's drafts verified)")
        self.spec_num_draft_tokens = counter("dabba:spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.spec_num_accepted_tokens = counter("dabba:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_acceptance_rate = gauge("dabba:spec_decode_acceptance_rate", "Accepted draft tokens / proposed ones")
        self.spec_mean_accepted_length = gauge("dabba:spec_decode_mean_accepted_length",
                                               "Tokens a speculative step gives a request: accepted drafts + 1")
        self._seen: dict[str, int] = {}  # the scheduler's running totals, as last counted

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_cache_tokens.set(stats.kv_tokens_stored)
        self.kv_cache_slot_utilization.set(stats.kv_slot_utilization)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        for name in ("num_preemptions", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
            total = getattr(stats, name)  # a counter advances by what the total grew since last time
            getattr(self, name).inc(total - self._seen.get(name, 0))
            self._seen[name] = total
        self.spec_acceptance_rate.set(stats.spec_acceptance_rate)
        self.spec_mean_accepted_length.set(stats.spec_mean_accepted_length)
