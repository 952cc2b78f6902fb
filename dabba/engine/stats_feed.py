"""Live engine snapshots for the dashboard (``GET /engine/stats`` and its server-sent-events stream
``/engine/stats/stream``): the batch, the last step, token totals, the prefix cache and every KV
block's state.

Only the engine thread reads the scheduler, so the engine thread builds each snapshot, between
two steps, and hands it over whole; any number of watchers read the latest one. While anyone
watches, every step publishes one (its counts are cheap); the block grid, a character per block,
is redrawn at most every GRID_EVERY_S while steps run, and always when the engine goes idle, so a
watcher's last snapshot shows the cache as it is left. A watcher takes at most one snapshot per
step and per STREAM_EVERY_S, whichever is rarer.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from dabba.core.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED
from dabba.engine.core import EngineCore

GRID_EVERY_S = 0.25
STREAM_EVERY_S = 0.25
HEARTBEAT_S = 10.0  # a watcher hears something this often when nothing changes (a gone client shows)


@dataclass
class StatsFeed:
    watchers: int = 0  # streams reading (written by the event loop, read by the engine thread)
    latest: dict[str, Any] | None = None
    # counted by the engine thread as it publishes each step's outputs (AsyncLLMEngine._publish)
    num_steps: int = 0
    num_prompt_tokens: int = 0  # of requests that got their first token: prefilled and sampled
    num_generated_tokens: int = 0
    _grid: str = ""
    _grid_time: float = float("-inf")


    def shows_idle(self) -> bool:
        """Whether the latest snapshot has nothing running or waiting (aborts end requests
        between steps: the engine then publishes once more)."""
        return self.latest is None or (self.latest["running"] == 0 and self.latest["waiting"] == 0)

    def publish(self, core: EngineCore, idle: bool) -> dict[str, Any]:
        """Take a snapshot (on the engine thread, between steps) and make it the latest."""
        now = time.monotonic()
        redraw = idle or now - self._grid_time >= GRID_EVERY_S
        kv = core.kv_blocks(with_grid=redraw)
        if redraw:
            self._grid, self._grid_time = kv.grid, now
        stats = core.get_stats()
        blocks = Counter(self._grid)
        snapshot = {
            "time": time.time(),
            "step": self.num_steps,
            "running": stats.num_running_reqs,
            "waiting": stats.num_waiting_reqs,
            "step_tokens": core.last_step_num_tokens if not idle else 0,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": stats.num_preemptions,
            "prefix_cache": {"hit_rate": stats.prefix_cache_hit_rate, "hit_tokens": stats.prefix_cache_hit_tokens,
                             "queried_tokens": stats.prefix_cache_queried_tokens},
            "kv": {"blocks": kv.num_blocks, "block_size": kv.block_size, "usage": stats.kv_cache_usage,
                   "blocks_in_use": stats.kv_blocks_used,  # now; the grid's counts are as of its drawing
                   "free": blocks[BLOCK_FREE], "cached": blocks[BLOCK_CACHED], "used": blocks[BLOCK_USED],
                   "shared": blocks[BLOCK_SHARED], "grid": self._grid},
            "spec_decode": {"draft_tokens": stats.spec_num_draft_tokens,
                            "accepted_tokens": stats.spec_num_accepted_tokens,
                            "acceptance_rate": stats.spec_acceptance_rate},
        }
        self.latest = snapshot  # watchers tell a new one by its identity
        return snapshot


async def watch(feeds: list[StatsFeed], snapshots_now: Callable[[], Awaitable[list[dict]]],
                combine: Callable[[list[dict]], dict]) -> AsyncIterator[dict | None]:
    """Snapshots of one engine's feed (or of data-parallel replicas' feeds, combined) as they
    step: one of now first, then one whenever a feed has a new one, at most per STREAM_EVERY_S;
    None after HEARTBEAT_S without one (so that a server notices a client gone while idle)."""
    for feed in feeds:
        feed.watchers += 1
    try:
        seen = await snapshots_now()  # each feed's latest, taken now
        yield combine(seen)
        quiet = 0.0
        while True:
            await asyncio.sleep(STREAM_EVERY_S)
            latest = [feed.latest for feed in feeds]
            if any(a is not b for a, b in zip(latest, seen)):
                seen, quiet = latest, 0.0
                yield combine(latest)
            elif (quiet := quiet + STREAM_EVERY_S) >= HEARTBEAT_S:
                quiet = 0.0
                yield None
    finally:
        for feed in feeds:
            feed.watchers -= 1


def combine_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Data-parallel replicas' snapshots as one engine's: counts add up, ratios are taken again
    from the sums, and the block grid is the replicas' grids one after the other."""
    def total(*path: str) -> Any:
        values = []
        for snapshot in snapshots:
            for key in path:
                snapshot = snapshot[key]
            values.append(snapshot)
        return sum(values)

    kv_keys = ("blocks", "blocks_in_use", "free", "cached", "used", "shared")
    hit, queried = total("prefix_cache", "hit_tokens"), total("prefix_cache", "queried_tokens")
    drafted, accepted = total("spec_decode", "draft_tokens"), total("spec_decode", "accepted_tokens")
    return {
        "time": max(s["time"] for s in snapshots),
        **{key: total(key) for key in ("step", "running", "waiting", "step_tokens", "prompt_tokens",
                                       "generated_tokens", "preemptions")},
        "prefix_cache": {"hit_rate": hit / queried if queried else 0.0, "hit_tokens": hit, "queried_tokens": queried},
        "kv": {**{key: total("kv", key) for key in kv_keys}, "block_size": snapshots[0]["kv"]["block_size"],
               "usage": total("kv", "blocks_in_use") / max(total("kv", "blocks"), 1),
               "grid": "".join(s["kv"]["grid"] for s in snapshots)},
        "spec_decode": {"draft_tokens": drafted, "accepted_tokens": accepted,
                        "acceptance_rate": accepted / drafted if drafted else 0.0},
        "replicas": [{"running": s["running"], "waiting": s["waiting"], "kv_usage": s["kv"]["usage"]}
                     for s in snapshots],
    }
