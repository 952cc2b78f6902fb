"""What the scheduler reports of the batch, the KV cache and speculative decoding: one snapshot
(``LLM.get_stats()``, ``/metrics``, ``dabba bench``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """A snapshot of the batch and the KV cache (``LLM.get_stats()``, ``/metrics``)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # blocks in use / blocks
    prefix_cache_hit_rate: float  # prompt tokens found in the cache / prompt tokens looked up
    num_preemptions: int
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_slots_allocated: int = 0  # token slots of the blocks in use
    kv_tokens_stored: int = 0  # of those, slots holding a computed token (shared blocks once)
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    spec_num_drafts: int = 0  # speculative steps: a request's drafts verified once
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_images_encoded: int = 0  # images the vision encoder ran on (one served from its cache is not counted)
    # the host-memory tier under the pool (core/kv_offload.py): what it holds, and block counts since start
    kv_offload_memory_bytes: int = 0
    kv_offload_memory_stored_bytes: int = 0
    kv_offload_memory_loaded_bytes: int = 0
    kv_offload_memory_hit_blocks: int = 0  # blocks a prompt found there, not in the pool (and loaded)
    kv_offload_memory_missed_blocks: int = 0  # prompt blocks found neither in the pool nor there
    kv_offload_disk_bytes: int = 0  # the disk tier's (as the memory tier's: the pool's bytes per block)
    kv_offload_disk_stored_bytes: int = 0
    kv_offload_disk_loaded_bytes: int = 0
    kv_offload_disk_hit_blocks: int = 0  # read back into memory for a prompt
    kv_offload_disk_failed_blocks: int = 0  # files that failed their checks (deleted; recomputed)

    @classmethod
    def combine(cls, parts: list["SchedulerStats"]) -> "SchedulerStats":
        """Data-parallel replicas' stats as one engine's: counts add up, and the ratios are
        taken again from the sums (a replica with more blocks weighs more)."""
        sums = {f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(cls)
                if f.type == "int"}
        return cls(**sums,
                   kv_cache_usage=sums["kv_blocks_used"] / sums["kv_blocks_total"] if sums["kv_blocks_total"] else 0.0,
                   prefix_cache_hit_rate=(sums["prefix_cache_hit_tokens"] / sums["prefix_cache_queried_tokens"]
                                          if sums["prefix_cache_queried_tokens"] else 0.0))

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed ones."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a speculative step gives a request on average: its accepted drafts and the one after."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_slot_utilization(self) -> float:
        """Real tokens / allocated slots: what paging wastes is only the unfilled tail of blocks."""
        return self.kv_tokens_stored / self.kv_slots_allocated if self.kv_slots_allocated else 0.0
