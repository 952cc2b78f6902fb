"""Prometheus metrics of one engine: queue sizes, KV-cache use, prefix-cache hits, preemptions,
speculative decoding's drafts and acceptance, token counters and latency histograms (time to
first token, per output token, end to end). Data-parallel replicas share one registry: each
replica's series carry replica="0", "1", ..., and replica="all" sums them."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dabba.core.stats import SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

GAUGES = {
    "num_requests_running": ("dabba:num_requests_running", "Requests in the running batch"),
    "num_requests_waiting": ("dabba:num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_cache_usage": ("dabba:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)"),
    "kv_cache_tokens": ("dabba:kv_cache_tokens", "KV-cache slots holding a computed token (shared blocks once)"),
    "kv_cache_slot_utilization": ("dabba:kv_cache_slot_utilization", "Slots holding a token / slots of the blocks in use"),
    "prefix_cache_hit_rate": ("dabba:prefix_cache_hit_rate",
                              "Prompt tokens served from the prefix cache / prompt tokens looked up"),
    "spec_acceptance_rate": ("dabba:spec_decode_acceptance_rate", "Accepted draft tokens / proposed ones"),
    "spec_mean_accepted_length": ("dabba:spec_decode_mean_accepted_length",
                                  "Tokens a speculative step gives a request: accepted drafts + 1"),
    "kv_offload_memory_bytes": ("dabba:kv_offload_memory_bytes", "Bytes of KV blocks the host-memory tier holds"),
    "kv_offload_disk_bytes": ("dabba:kv_offload_disk_bytes", "Bytes of KV blocks the disk tier holds"),
}
COUNTERS = {
    "num_preemptions": ("dabba:num_preemptions", "Requests preempted (KV blocks ran out)"),
    "prompt_tokens": ("dabba:prompt_tokens", "Prompt tokens of requests that finished prefill"),
    "generation_tokens": ("dabba:generation_tokens", "Tokens generated"),
    "spec_num_drafts": ("dabba:spec_decode_num_drafts", "Speculative steps (a request's drafts verified)"),
    "spec_num_draft_tokens": ("dabba:spec_decode_num_draft_tokens", "Draft tokens proposed and verified"),
    "spec_num_accepted_tokens": ("dabba:spec_decode_num_accepted_tokens", "Draft tokens accepted"),
    "kv_offload_memory_stored_bytes": ("dabba:kv_offload_memory_stored_bytes",
                                       "Bytes of evicted prefix blocks copied into the host-memory tier"),
    "kv_offload_memory_loaded_bytes": ("dabba:kv_offload_memory_loaded_bytes",
                                       "Bytes of prefix blocks loaded back from the host-memory tier"),
    "kv_offload_memory_hit_blocks": ("dabba:kv_offload_memory_hit_blocks",
                                     "Prompt blocks missed by the pool and found in the host-memory tier"),
    "kv_offload_memory_missed_blocks": ("dabba:kv_offload_memory_missed_blocks",
                                        "Prompt blocks found neither in the pool nor in the host-memory tier"),
    "kv_offload_disk_stored_bytes": ("dabba:kv_offload_disk_stored_bytes", "Bytes of KV blocks written to the disk tier"),
    "kv_offload_disk_loaded_bytes": ("dabba:kv_offload_disk_loaded_bytes", "Bytes of KV blocks read from the disk tier"),
    "kv_offload_disk_hit_blocks": ("dabba:kv_offload_disk_hit_blocks", "Prompt blocks read back from the disk tier"),
    "kv_offload_disk_failed_blocks": ("dabba:kv_offload_disk_failed_blocks",
                                      "Disk tier files that failed their checks (deleted; their blocks recomputed)"),
}
HISTOGRAMS = {
    "time_to_first_token": ("dabba:time_to_first_token_seconds", "Arrival to first output token"),
    "time_per_output_token": ("dabba:time_per_output_token_seconds", "Mean gap between output tokens of a request"),
    "e2e_request_latency": ("dabba:e2e_request_latency_seconds", "Arrival to finish"),
}
# Counted as requests go (AsyncLLMEngine._publish), so a replica's count also goes to the sum's.
PER_REQUEST = ("prompt_tokens", "generation_tokens", "time_to_first_token", "time_per_output_token",
               "e2e_request_latency")


class MetricFamilies:
    """Every metric once in one registry; each EngineMetrics takes the children of its labels."""

    def __init__(self, labelnames: tuple[str, ...] = ("model_name",)) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, labelnames
        self.families = {
            **{k: Gauge(name, doc, labels, registry=r) for k, (name, doc) in GAUGES.items()},
            **{k: Counter(name, doc, labels, registry=r) for k, (name, doc) in COUNTERS.items()},
            **{k: Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r) for k, (name, doc) in HISTOGRAMS.items()},
        }


class _Both:
    """A replica's counter or histogram and the replicas' sum's, advanced together."""

    def __init__(self, mine: Counter | Histogram, total: Counter | Histogram) -> None:
        self.mine, self.total = mine, total

    def inc(self, amount: float = 1) -> None:
        self.mine.inc(amount)
        self.total.inc(amount)

    def observe(self, value: float) -> None:
        self.mine.observe(value)
        self.total.observe(value)


class EngineMetrics:
    """One engine's metrics: alone (labels model_name), or a data-parallel replica's (labels
    model_name, replica) whose per-request counts also reach ``total``, the replicas' sum. The
    scheduler's gauges are set when scraped, from one engine's stats (observe_scheduler) or,
    for the sum, from the replicas' stats combined (SchedulerStats.combine)."""

    def __init__(self, model_name: str, replica: str | None = None, families: MetricFamilies | None = None,
                 total: "EngineMetrics | None" = None) -> None:
        families = families or MetricFamilies()
        self.registry = families.registry
        labels = (model_name,) if replica is None else (model_name, replica)
        for key, family in families.families.items():
            child = family.labels(*labels)
            setattr(self, key, _Both(child, getattr(total, key)) if total is not None and key in PER_REQUEST else child)
        self._seen: dict[str, int] = {}  # the scheduler's running totals, as last counted

    @classmethod
    def replicated(cls, model_name: str, replicas: int) -> tuple[list["EngineMetrics"], "EngineMetrics"]:
        """Each replica's metrics and their sum's (replica="all"), in one registry."""
        families = MetricFamilies(("model_name", "replica"))
        total = cls(model_name, "all", families)
        return [cls(model_name, str(i), families, total) for i in range(replicas)], total

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_cache_tokens.set(stats.kv_tokens_stored)
        self.kv_cache_slot_utilization.set(stats.kv_slot_utilization)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        self.kv_offload_memory_bytes.set(stats.kv_offload_memory_bytes)
        self.kv_offload_disk_bytes.set(stats.kv_offload_disk_bytes)
        for name in ("num_preemptions", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
                     *(f"kv_offload_{tier}_{what}" for tier in ("memory", "disk")
                       for what in ("stored_bytes", "loaded_bytes", "hit_blocks")),
                     "kv_offload_memory_missed_blocks", "kv_offload_disk_failed_blocks"):
            total = getattr(stats, name)  # a counter advances by what the total grew since last time
            getattr(self, name).inc(total - self._seen.get(name, 0))
            self._seen[name] = total
        self.spec_acceptance_rate.set(stats.spec_acceptance_rate)
        self.spec_mean_accepted_length.set(stats.spec_mean_accepted_length)
