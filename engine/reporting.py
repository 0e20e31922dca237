"""What an engine reports between steps: its stats, its requests' progress, its prefix cache's changes.

The backend reads all three after each step (actors/engine_core.py) for the router, which
keeps a ledger of each backend's requests, a cost model of its steps and a mirror of its
prefix-cache index. So each is cheap to read and says only what changed: a step's size and
time and running totals (`get_stats`); the state of each request that changed since the last
call, as absolute counts, so a late or repeated report is harmless (`drain_progress`); and the
block hashes whose KV tier changed since the last call (`drain_cache_changes`).

Which requests changed is one dict, `changed`, that every part of the engine marks as it moves
a request (admission, a launch, output processing, the groups) and only `drain_progress`
empties. The KV cache's tier changes (engine/kv_cache/manager.py's `on_change`) land in
`CacheChanges`, made before the cache that calls it.
"""

from __future__ import annotations

import time
from collections import deque

from tandem.engine.kv_cache.manager import TIER_DEVICE, KVCacheManager
from tandem.engine.outputs import EngineStats, RequestProgress
from tandem.engine.request import Request, RequestStatus
from tandem.engine.request_groups import RequestGroup, RequestGroups
from tandem.engine.scheduler import Scheduler

RESCAN_BLOCKS_PER_DRAIN = 4096  # block lookups one progress drain spends re-checking waiting requests' hits
_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class CacheChanges:
    """Where each changed block hash is held, latest state per hash (1 the device, 2 the host
    tier only, 0 nowhere: manager.py's TIER_*), and whether anything left the device since the
    last progress report."""

    def __init__(self) -> None:
        self.changes: dict[int, int] = {}
        self.evicted = False

    def on_change(self, block_hash: int, state: int) -> None:
        if state != TIER_DEVICE:
            self.evicted = True
        self.changes[block_hash] = state

    def drain(self) -> dict[int, int]:
        changes, self.changes = self.changes, {}
        return changes


class EngineReporter:
    def __init__(self, scheduler: Scheduler, kv_cache_manager: KVCacheManager, groups: RequestGroups,
                 cache_changes: CacheChanges, changed: dict[str, Request]) -> None:
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.groups = groups
        self.cache_changes = cache_changes
        self.changed = changed
        self.stats = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0)
        self._last_finish = 0.0
        self._rescan: deque[Request] = deque()  # the waiting requests an eviction's pass has still to look at
        self._reported_cached: dict[str, int] = {}  # queued request -> the prefix hit last reported

    def record_step(self, num_prefill: int, num_decode: int, start: float, device_wait_s: float = 0.0) -> None:
        """A step whose sampled ids just landed; `start` is perf_counter() when its launch began,
        `device_wait_s` how long the loop then waited for those ids."""
        now = time.perf_counter()
        # The step's share of the wall: from its launch, or from the previous step's end when
        # it was launched while that one ran.
        elapsed = now - max(start, self._last_finish)
        self._last_finish = now
        st = self.stats
        st.step_time_s = elapsed
        st.step_prefill_tokens = num_prefill
        st.step_decode_tokens = num_decode
        if num_prefill:
            st.prefill_time_s += elapsed
        else:
            st.decode_time_s += elapsed
        st.num_prompt_tokens_total += num_prefill
        st.num_generation_tokens_total += num_decode
        st.device_wait_time_s += min(device_wait_s, elapsed)
        st.num_steps += 1

    def get_stats(self) -> EngineStats:
        st, kv = self.stats, self.kv_cache_manager
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        st.num_free_blocks = kv.block_pool.get_num_free_blocks()
        st.num_total_blocks = kv.num_usable_blocks
        st.kv_cache_usage = kv.usage
        st.prefix_cache_queries = kv.prefix_cache_queries
        st.prefix_cache_hits = kv.prefix_cache_hits
        st.num_preemptions = self.scheduler.num_preemptions
        tier = kv.host_tier
        if tier is not None:
            st.prefix_cache_host_hits = kv.prefix_cache_host_hits
            st.kv_host_offloaded_blocks = tier.num_offloaded_blocks
            st.kv_host_reloaded_blocks = tier.num_reloaded_blocks
            st.num_host_used_blocks = tier.num_used_blocks
            st.num_host_total_blocks = tier.num_blocks
        return st

    def drain_progress(self) -> list[RequestProgress]:
        """State of every request that changed since the last call. After a cache eviction,
        waiting requests whose prefix hit changed are re-reported with it in `num_cached_tokens`
        (`_rescan_waiting`)."""
        changed = self.changed
        self._rescan_waiting(changed)
        progress: list[RequestProgress] = []
        groups: dict[str, RequestGroup] = {}
        child_of = self.groups.child_of
        for req_id, request in changed.items():
            entry = child_of.get(req_id) if child_of else None
            if entry is None:
                progress.append(self.progress(request))
            else:
                groups[entry[0].req_id] = entry[0]
        changed.clear()
        progress.extend(self.groups.progress(group, self.progress) for group in groups.values())
        return progress

    def _rescan_waiting(self, changed: dict[str, Request]) -> None:
        """An eviction can shrink a waiting request's prefix hit, which the router counts in the
        backend's queued work. Past saturation the queue is long and evictions come every step,
        so a pass over the queue is spread over drains, each re-checking requests until it has
        spent `RESCAN_BLOCKS_PER_DRAIN` block lookups (at least one request), and a request is
        re-reported only when its hit differs from the one last reported: a drain's cost and the
        router's traffic stay bounded however long the queue and its prompts grow."""
        if self.cache_changes.evicted and not self._rescan:
            self.cache_changes.evicted = False
            self._rescan.extend(self.scheduler.waiting)
        reported, budget, block_size = self._reported_cached, RESCAN_BLOCKS_PER_DRAIN, self.kv_cache_manager.block_size
        while budget > 0 and self._rescan:
            request = self._rescan.popleft()
            if request.status not in _QUEUED or request.req_id in changed:
                continue
            budget -= request.num_tokens // block_size + 1
            if reported.get(request.req_id) != self.kv_cache_manager.num_request_cached_tokens(request):
                changed[request.req_id] = request

    def progress(self, request: Request) -> RequestProgress:
        if request.is_finished and not request.num_pending_tokens:
            status = "finished"
        elif request.is_finished:
            status = "running"  # its last token is still on the device
        else:
            status = request.status.value
        cached = request.num_cached_tokens
        if request.status in _QUEUED:
            cached = self._reported_cached[request.req_id] = self.kv_cache_manager.num_request_cached_tokens(request)
        else:
            self._reported_cached.pop(request.req_id, None)
        return RequestProgress(request.req_id, status, request.num_prompt_tokens, cached,
                               request.num_computed_prompt_tokens, request.num_resolved_output_tokens,
                               request.max_tokens)
