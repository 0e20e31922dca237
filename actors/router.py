"""`RouterActor`: routing's `Router` and its ledgers behind a Ray actor, plus backend health.

Prefix-cache hits on the decision path. The cost model needs each backend's reusable prefix
for the new prompt. The router never asks a backend for it: each backend's batched progress
reports also carry the block hashes it published or evicted, and the router keeps a mirror of
every backend's prefix-cache index (actors/cache_mirror.py). A decision hashes the prompt once
and looks it up locally, so no backend round trip, slow or dead backend, sits in front of it.

Backends come and go. A backend registers itself (`add_backend`) when it starts, and again
after Ray restarts it. It is dropped at once when a caller reports that a call to it failed
(`backend_failed`) or when a periodic ping raises; its queued requests then fail over at their
callers (see cluster/dispatch.py), which re-route them. Each registration carries a fresh
`instance_id`, so a late failure report about the previous incarnation cannot drop the new one.
A ping that merely times out is not a death: a busy host (another backend loading a model, the
GCS catching up) can delay an answer by seconds. Only `HEALTH_CHECK_MISSES` timeouts in a row
drop a backend, as Ray Serve's replica health check does, and a backend dropped that way keeps
being pinged: when it answers again as the same instance it is asked to register again, since
nothing else would bring an actor that never restarted back into routing.

Placing a request has one verb: `place` returns the whole `Decision` (its record, the
backend's handle) for tests and diagnostics, and `place_many` places a batch for the serving
path (cluster/dispatch.py), each request a `PlaceRequest` answered with a `Placement` (backend
id, instance id, estimated seconds, projected TTFT) only, since every caller pays to receive
the reply.

Deadlines and priorities. A placement may carry the request's priority class and TTFT deadline
(routing/deadline.py); a request whose deadline no backend can meet is refused (routing's
`DeadlineRefusedError`: the best projection, when to retry), placed nowhere, and logged as a
decision with `placed` false. The caller hears engine/errors.py's `DeadlineUnmetError` (an
overload: retry later), or an `InvalidRequestError` when even an idle backend would miss the
deadline (`deadline_error`, the one translation). Every placement answers with the projected
TTFT it was placed with, and the router compares it with the TTFT it observes (decision to the
first report that shows a token): `tandem_router_ttft_late_seconds` / `_early_seconds`.

Every decision is appended to the routing log as one JSON line (routing's `DecisionRecord`
plus a timestamp, the per-backend cache answers, and the request's lengths and prompt block
hashes, from which `tandem route-sim --replay` replays the traffic), and exported as metrics:
decisions by backend and policy, each backend's score, pending seconds, and estimated vs realised
completion time (decision to the backend's "finished" report).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tandem.actors import wire
from tandem.actors.cache_mirror import CacheMirror, MirrorIndex
from tandem.actors.detached import detached
from tandem.actors.messages import BackendInfo, Decision, Placement, PlaceRequest, StepTiming
from tandem.actors.metrics import ROUTER_METRICS, Recorder
from tandem.engine.errors import BackendUnavailableError, DeadlineUnmetError, InvalidRequestError
from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.routing.decision import DecisionRecord

PENDING_EXPORT_S = 0.05
_NOT_RUNNING = frozenset({"finished", "waiting", "preempted"})  # the statuses _events_for reads
HEALTH_CHECK_MISSES = 3  # pings timed out in a row before a live-but-silent backend leaves routing
_LOG_ENCODER = msgspec.json.Encoder()  # the routing log's lines: compact JSON
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(DecisionRecord))

logger = logging.getLogger("tandem.router")


@dataclass
class _Backend:
    info: BackendInfo
    handle: Any
    rates: Any  # routing.RateProfile
    cache: CacheMirror


def deadline_error(exc: Any) -> Exception:
    """routing's `DeadlineRefusedError` as the caller's error: an overload (a 429, retry after the
    drain) while backends are busy, the request's own fault (a 400) when even an idle backend
    would miss the deadline (its prefill alone is too long)."""
    if exc.retry_after_s is None:
        return InvalidRequestError(str(exc), param="ttft_deadline_ms", code="deadline_unmeetable")
    return DeadlineUnmetError(str(exc), exc.projected_ttft_s, exc.retry_after_s)


@dataclass
class _Routed:
    backend_id: str
    num_cached_tokens: int
    decided_at: float
    estimated_s: float
    projected_ttft_s: float = 0.0
    first_token_seen: bool = False


class RouterActor:
    def __init__(self, policy: str = "cost", routing_log: str | None = None,
                 health_check_period_s: float = 1.0,
                 rates_by_backend: dict[str, dict[str, Any]] | None = None,
                 calibration_alpha: float | None = None, new_token_ratio: bool = False,
                 spill_margin: float = 0.0, spill_allow_queue: bool = True, device_shares: bool = False) -> None:
        from tandem.routing import CalibrationConfig, NewTokenRatioConfig, Router, SpillGuard

        self.router = Router(
            [], policy=policy,
            new_token_ratio=NewTokenRatioConfig() if new_token_ratio else None,
            calibration=CalibrationConfig(calibration_alpha) if calibration_alpha else None,
            spill_guard=SpillGuard(spill_margin, spill_allow_queue), device_shares=device_shares)
        self.policy = self.router.policy
        self.health_check_period_s = health_check_period_s
        self.backends: dict[str, _Backend] = {}
        self.mirrors = MirrorIndex()  # every backend's prefix mirror inverted, for one walk per prompt
        self._bit_owner: dict[int, str] = {}  # mirror bit position -> backend
        self._mirror_bits: dict[int, int] = {}  # block size -> bitmask of the backends' mirrors of that size
        self.known_rates: dict[str, dict[str, Any]] = dict(rates_by_backend or {})
        self.routed: dict[str, _Routed] = {}
        self.metrics = Recorder(ROUTER_METRICS)
        self.log_path = Path(routing_log) if routing_log else None
        self._log = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab", buffering=0)  # unbuffered: each decision's line written whole
        self._health_task: asyncio.Task | None = None
        self._misses: dict[str, int] = {}  # backend -> health checks timed out in a row
        self._silent: dict[str, _Backend] = {}  # dropped for timeouts, still pinged (see the module doc)
        self._pending_export: asyncio.TimerHandle | None = None
        self._latest_scores: dict[str, Any] = {}  # the last decision's score per backend, for its gauge
        self._wire: wire.WireServer | None = None
        self._rates_logged: set[str] = set()  # backends whose rates the routing log has since they (re)joined

    # -- membership --------------------------------------------------------------------------
    async def add_backend(self, info: BackendInfo, handle: Any, cached_hashes: list[int] = ()) -> None:
        """(Re)join routing; `cached_hashes` is the backend's prefix-cache index right now."""
        from tandem.routing import BackendSpec, RateProfile

        rates = info.rates or self.known_rates.get(info.backend_id)
        if rates is None:
            raise ValueError(f"backend {info.backend_id} registered without rates and none are known; "
                             "profile it (tandem profile) or pass a rates file")
        self.known_rates[info.backend_id] = rates
        self._silent.pop(info.backend_id, None)
        if info.backend_id in self.backends:
            self._drop(info.backend_id, reason="re-registered")
        profile = RateProfile(**rates)
        self._rates_logged.discard(info.backend_id)
        self.router.add_backend(BackendSpec(info.backend_id, info.routing_kind, profile, info.max_active,
                                            info.shared_device or None, info.max_priority_wait_s))
        mirror = CacheMirror(info.block_size, cached_hashes, self.mirrors)
        self.backends[info.backend_id] = _Backend(info, handle, profile, mirror)
        self._bit_owner[mirror.bit.bit_length() - 1] = info.backend_id
        self._mirror_bits[info.block_size] = self._mirror_bits.get(info.block_size, 0) | mirror.bit
        logger.warning("router: backend %s (%s, instance %s) %s routing", info.backend_id, info.device,
                       info.instance_id, "rejoined" if info.reconstructed else "joined")
        self._export_membership()
        self._ensure_health_task()

    async def backend_failed(self, backend_id: str, instance_id: str | None = None, reason: str = "") -> bool:
        """A caller saw a call to this backend fail: stop routing to it now."""
        backend = self.backends.get(backend_id)
        if backend is None or (instance_id is not None and backend.info.instance_id != instance_id):
            return False
        self._drop(backend_id, reason=reason or "a call to it failed")
        self.metrics.inc("tandem_router_backend_failures", tags={"backend": backend_id})
        return True

    def _drop(self, backend_id: str, reason: str) -> None:
        backend = self.backends.pop(backend_id, None)
        if backend is not None:
            mirror = backend.cache
            del self._bit_owner[mirror.bit.bit_length() - 1]
            remaining = self._mirror_bits[mirror.block_size] & ~mirror.bit
            if remaining:
                self._mirror_bits[mirror.block_size] = remaining
            else:
                del self._mirror_bits[mirror.block_size]
            mirror.leave()
        self._misses.pop(backend_id, None)
        removed = self.router.remove_backend(backend_id)
        for req_id in (*removed.queued, *removed.active):
            self.routed.pop(req_id, None)
        logger.warning("router: dropped backend %s (%s); %d queued and %d active requests fail over at "
                       "their callers", backend_id, reason, len(removed.queued), len(removed.active))
        # Nothing is pending on a backend that is out of routing; its gauges would otherwise
        # keep their last values until it rejoins.
        self.metrics.set("tandem_router_pending_seconds", 0.0, tags={"backend": backend_id})
        self.metrics.set("tandem_router_pending_requests", 0, tags={"backend": backend_id})
        self._export_membership()

    async def set_policy(self, policy: str, cordoned: list[str] = ()) -> None:
        """Route later requests with `policy`, giving none to the `cordoned` backends (a
        benchmark compares its arms on one cluster this way)."""
        self.router.set_policy(policy)
        self.policy = self.router.policy
        for backend_id in self.router.backend_ids():
            self.router.set_cordoned(backend_id, backend_id in cordoned)

    async def set_max_active(self, backend_id: str, max_active: int) -> None:
        """A backend changed its max_active (BackendActor.set_max_active tells us)."""
        self.router.set_max_active(backend_id, max_active)
        backend = self.backends.get(backend_id)
        if backend is not None:
            backend.info = dataclasses.replace(backend.info, max_active=max_active)

    async def list_backends(self) -> dict[str, Any]:
        """backend_id -> actor handle, for routable backends."""
        return {backend_id: b.handle for backend_id, b in self.backends.items()}

    async def backend_infos(self) -> dict[str, BackendInfo]:
        return {backend_id: b.info for backend_id, b in self.backends.items()}

    async def rates(self) -> dict[str, dict[str, Any]]:
        return dict(self.known_rates)

    async def rates_in_use(self) -> dict[str, dict[str, Any]]:
        """The rates the cost model uses right now (calibrated, if calibration is on)."""
        return {backend_id: dataclasses.asdict(self.router.rates(backend_id)) for backend_id in self.router.backend_ids()}

    # -- decisions ---------------------------------------------------------------------------
    async def place(self, req_id: str, prompt_token_ids: list[int], max_tokens: int, attempt: int = 1,
                    priority: int = 0, ttft_deadline_s: float | None = None) -> Decision:
        """Place a request and return the whole decision: its record and the backend's handle.
        `attempt` > 1 means its previous backend failed before it started; `priority` and
        `ttft_deadline_s` are as in `PlaceRequest`."""
        record, backend = self._place(req_id, prompt_token_ids, max_tokens, attempt, priority, ttft_deadline_s)
        return Decision(req_id, record.backend_id, backend.info.instance_id, record.to_dict(), record.chosen.score_s,
                        backend.handle, record.chosen.projected_ttft_s)

    def place_many(self, requests: list[tuple]) -> list[Any]:
        """Place several requests, each the one-item argument tuple `(PlaceRequest,)`, in order
        (actors/batching.py); each answer is a `Placement`, or the exception `place` would have
        raised. Callers keep the handles from `list_backends`."""
        answers: list[Any] = []
        for (request,) in requests:
            try:
                request = msgspec.convert(request, PlaceRequest)  # an array when it came on the wire
                record, backend = self._place(request.req_id, request.prompt_token_ids, request.max_tokens,
                                              request.attempt, request.priority, request.ttft_deadline_s)
            except Exception as exc:
                answers.append(exc)
            else:
                answers.append(Placement(record.backend_id, backend.info.instance_id, record.chosen.score_s,
                                         record.chosen.projected_ttft_s))
        return answers

    async def wire_address(self) -> tuple[str, tuple[str, bytes]]:
        """(node id, address) of the same-node wire on which callers of this node send their
        `place_many` batches without a Ray call each (actors/wire.py); started on first call."""
        if self._wire is None:
            self._wire = wire.WireServer()
            await self._wire.start(wire.call_server(self.place_many))
        return wire.node_id(), self._wire.address

    def _place(self, req_id: str, prompt_token_ids: list[int], max_tokens: int, attempt: int,
               priority: int = 0, ttft_deadline_s: float | None = None) -> tuple[Any, _Backend]:
        from tandem import routing

        hashes = {block_size: hash_request_blocks(prompt_token_ids, block_size) for block_size in self._mirror_bits}
        num_cached, num_host_cached = self._cache_answers(hashes, len(prompt_token_ids))
        if not self.backends:
            raise BackendUnavailableError("no backend is alive")
        block_size = min(hashes)  # the finest block size keys prefix-affinity and the in-flight prefixes
        request = routing.RouteRequest(req_id, len(prompt_token_ids), max_tokens, num_cached,
                                       tuple(hashes[block_size]), block_size, priority, ttft_deadline_s,
                                       arrival_s=time.monotonic(), num_host_cached_tokens=num_host_cached)
        try:
            record = self.router.route(request)
        except routing.NoBackendError as exc:
            raise BackendUnavailableError(str(exc)) from None
        except routing.DeadlineRefusedError as exc:
            self._refused(exc, request, attempt)
            raise deadline_error(exc) from None
        chosen = record.chosen
        now = time.time()
        self.routed[req_id] = _Routed(record.backend_id, num_cached.get(record.backend_id, 0), now, chosen.score_s,
                                      chosen.projected_ttft_s)
        if self._log is not None:
            self._log_decision(now, record, request, attempt)
        self._export_decision(record)
        if attempt > 1:
            self.metrics.inc("tandem_router_reroutes", tags={"backend": record.backend_id})
        return record, self.backends[record.backend_id]

    def _refused(self, exc: Any, request: Any, attempt: int) -> None:
        """Account a request refused for its deadline: the log line and the refusal counter."""
        if self._log is not None and exc.record is not None:
            self._log_decision(time.time(), exc.record, request, attempt)
        self.metrics.inc("tandem_router_deadline_refusals", tags={"backend": exc.backend_id})

    def _cache_answers(self, hashes: dict[int, list[int]], num_tokens: int) -> tuple[dict[str, int], dict[str, int]]:
        """Every backend's device hit (all backends, in routing order) and host-tier run (only the
        backends with one), from the inverted mirror: the same answers as `_num_cached` and
        `_num_host_cached`, the per-backend reference."""
        num_cached = dict.fromkeys(self.backends, 0)
        host_hits: dict[str, int] = {}
        owner = self._bit_owner
        for block_size, candidates in self._mirror_bits.items():
            device, host = self.mirrors.answers(hashes[block_size], num_tokens, block_size, candidates)
            for position, n in device.items():
                num_cached[owner[position]] = n
            for position, n in host.items():
                host_hits[owner[position]] = n
        if host_hits:  # in routing order, as the reference gives them
            host_hits = {backend_id: host_hits[backend_id] for backend_id in self.backends if backend_id in host_hits}
        return num_cached, host_hits

    def _num_cached(self, hashes: dict[int, list[int]], num_tokens: int) -> dict[str, int]:
        return {backend_id: b.cache.num_cached_tokens(hashes[b.info.block_size], num_tokens)
                for backend_id, b in self.backends.items()}

    def _num_host_cached(self, hashes: dict[int, list[int]], num_tokens: int,
                         num_cached: dict[str, int]) -> dict[str, int]:
        """Per backend with a host tier, the prefix its host tier holds after its device hit."""
        return {backend_id: n for backend_id, b in self.backends.items() if b.cache.host
                and (n := b.cache.num_host_cached_tokens(hashes[b.info.block_size], num_tokens,
                                                         num_cached[backend_id]))}

    async def forget(self, req_id: str) -> bool:
        """The caller gave up on a request before its backend reported it finished (its client
        went away, or it failed). The pending gauges follow the ledger at once: they would
        otherwise show the request until the backend's next report, which an idle backend
        never sends."""
        self.routed.pop(req_id, None)
        found = self.router.forget(req_id)
        if found:
            self._export_pending()
        return found

    def _log_decision(self, now: float, record: Any, request: Any, attempt: int) -> None:
        """One JSON line: the decision (the `DecisionRecord`'s fields, floats at full precision),
        the cache answers, and what `tandem route-sim --replay` needs to replay the request (its
        lengths and its prompt's block hashes). The first line that scores a backend after it
        (re)joined also carries its whole rate profile under `rates`, the batch table included, so
        a replay decodes in batches as the backend does. msgspec encodes the records' dataclasses
        as they are: rounding and copying them into dicts cost the router more than the decision
        (docs/benchmarks/router-scaling-2core.md)."""
        fields = {name: getattr(record, name) for name in _RECORD_FIELDS}
        line = {"ts": round(now, 6), **fields, "cache_answers": request.num_cached_tokens,
                "host_cache_answers": request.num_host_cached_tokens, "attempt": attempt,
                "num_prompt_tokens": request.num_prompt_tokens, "max_tokens": request.max_tokens,
                "block_size": request.block_size, "block_hashes": list(request.block_hashes)}
        unlogged = [backend_id for backend_id in record.per_backend if backend_id not in self._rates_logged]
        if unlogged:
            line["rates"] = {backend_id: dataclasses.asdict(self.router.rates(backend_id)) for backend_id in unlogged}
            self._rates_logged.update(unlogged)
        self._log.write(_LOG_ENCODER.encode(line) + b"\n")

    def _export_decision(self, record: Any) -> None:
        self.metrics.inc("tandem_router_decisions", tags={"backend": record.backend_id, "policy": self.policy})
        self.metrics.observe("tandem_router_estimated_completion_seconds", record.chosen.score_s,
                             tags={"backend": record.backend_id})
        self._latest_scores = record.per_backend  # exported with the pending gauges, not per decision
        self._export_pending()

    def _export_pending(self) -> None:
        """Bring the pending gauges (and the last decision's estimated cost per backend) up to
        date within `PENDING_EXPORT_S`: one update for all the decisions and reports of that time,
        not one per request on the decision path (a scrape every few seconds sees only the latest
        value anyway, and a gauge per backend per decision costs the router in proportion to its
        backends: docs/benchmarks/router-scaling-2core.md)."""
        if self._pending_export is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the actor's loop (a plain call): at once
            self._set_pending_gauges()
            return
        self._pending_export = loop.call_later(PENDING_EXPORT_S, self._set_pending_gauges)

    def _set_pending_gauges(self) -> None:
        self._pending_export = None
        for backend_id, score in self._latest_scores.items():
            self.metrics.set("tandem_router_estimated_cost_seconds", score.score_s, tags={"backend": backend_id})
        for backend_id, summary in self.router.pending_summary().items():
            self.metrics.set("tandem_router_pending_seconds", summary.pending_s, tags={"backend": backend_id})
            self.metrics.set("tandem_router_pending_requests", summary.num_active + summary.num_queued,
                             tags={"backend": backend_id})

    def _export_membership(self) -> None:
        self.metrics.set("tandem_router_backends_alive", len(self.backends))
        for backend_id in self.backends:  # its per-backend series exist from the moment it joins
            self.metrics.declare({"backend": backend_id, "policy": self.policy})

    # -- progress ----------------------------------------------------------------------------
    async def report(self, backend_id: str, instance_id: str, progress: list[Any],
                     steps: list[StepTiming] = (), cache_changes: dict[int, int] | None = None) -> int:
        """A backend's batch of `engine.outputs.RequestProgress` (absolute counts), of its
        steps' `StepTiming`s, and of its prefix-cache index changes (block hash -> the tier that
        now holds it, actors/cache_mirror.py)."""
        backend = self.backends.get(backend_id)
        if backend is None or backend.info.instance_id != instance_id:
            return 0
        if cache_changes:
            backend.cache.apply(cache_changes)
            self.metrics.set("tandem_router_mirrored_cached_blocks", len(backend.cache.cached),
                             tags={"backend": backend_id})
            if backend.cache.host:
                self.metrics.set("tandem_router_mirrored_host_blocks", len(backend.cache.host),
                                 tags={"backend": backend_id})
        for step in steps:
            if step.elapsed_s > 0:
                self.router.observe_step(backend_id, step.prefill_tokens, step.decode_tokens, step.batch_size,
                                         step.elapsed_s)
        from tandem.routing import RunningProgress

        events = []
        now = time.time()
        routed = self.routed
        for p in progress:
            status = p.status
            if status in _NOT_RUNNING:
                events.extend(self._events_for(p))
            else:  # what _events_for gives, as one item the ledger applies at once
                events.append(RunningProgress(p.req_id, p.num_computed_prompt_tokens, p.num_output_tokens))
            if p.num_output_tokens > 0:
                seen = routed.get(p.req_id)
                if seen is not None and not seen.first_token_seen:
                    self._record_first_token(backend_id, p.req_id, now)
            if status == "finished":
                self._record_finished(backend_id, p.req_id)
        applied = self.router.on_progress(backend_id, events)
        self._export_pending()
        return applied

    def _events_for(self, p: Any) -> list[Any]:
        from tandem.routing import ProgressEvent

        if p.status == "finished":
            return [ProgressEvent(p.req_id, "finished")]
        if p.status in ("waiting", "preempted"):
            routed = self.routed.get(p.req_id)
            if p.status == "waiting" and routed is not None and p.num_cached_tokens < routed.num_cached_tokens:
                return [ProgressEvent(p.req_id, "evicted")]
            return []
        return [ProgressEvent(p.req_id, "admitted"),
                ProgressEvent(p.req_id, "prefill", p.num_computed_prompt_tokens),
                ProgressEvent(p.req_id, "generated", p.num_output_tokens)]

    def _record_first_token(self, backend_id: str, req_id: str, now: float) -> None:
        """Observed against projected TTFT, once per request: its first report with a token."""
        routed = self.routed.get(req_id)
        if routed is None or routed.first_token_seen:
            return
        routed.first_token_seen = True
        error_s = (now - routed.decided_at) - routed.projected_ttft_s
        name = "tandem_router_ttft_late_seconds" if error_s > 0 else "tandem_router_ttft_early_seconds"
        self.metrics.observe(name, abs(error_s), tags={"backend": backend_id})

    def _record_finished(self, backend_id: str, req_id: str) -> None:
        routed = self.routed.pop(req_id, None)
        if routed is None:
            return
        realised = time.time() - routed.decided_at
        tags = {"backend": backend_id}
        self.metrics.observe("tandem_router_realised_completion_seconds", realised, tags=tags)
        if routed.estimated_s > 0:
            self.metrics.observe("tandem_router_completion_ratio", realised / routed.estimated_s, tags=tags)

    async def pending_summary(self) -> dict[str, Any]:
        return {backend_id: vars(s) for backend_id, s in self.router.pending_summary().items()}

    # -- health ------------------------------------------------------------------------------
    def _ensure_health_task(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = detached(asyncio.get_running_loop().create_task, self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_period_s)
            await asyncio.gather(*(self._check(backend_id, backend) for backend_id, backend in list(self.backends.items())),
                                 *(self._recheck(backend_id, backend) for backend_id, backend in list(self._silent.items())))

    @property
    def _health_timeout_s(self) -> float:
        """How long a health check's call may take before it counts as a miss."""
        return max(2.0, 5 * self.health_check_period_s)

    async def _ping(self, backend: _Backend) -> str:
        return await asyncio.wait_for(_await_ref(backend.handle.ping.remote()), timeout=self._health_timeout_s)

    async def _check(self, backend_id: str, backend: _Backend) -> None:
        """One routable backend's ping: a raise drops it now, a run of timeouts drops it silent."""
        try:
            instance_id = await self._ping(backend)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            self._misses[backend_id] = misses = self._misses.get(backend_id, 0) + 1
            if misses >= HEALTH_CHECK_MISSES and await self.backend_failed(
                    backend_id, backend.info.instance_id, reason=f"{misses} health checks timed out"):
                self._silent[backend_id] = backend
            return
        except Exception as exc:  # died or restarting: not routable now, and it re-registers if Ray restarts it
            await self.backend_failed(backend_id, backend.info.instance_id,
                                      reason=f"health check failed: {type(exc).__name__}")
            return
        self._misses.pop(backend_id, None)
        if instance_id != backend.info.instance_id:
            await self.backend_failed(backend_id, backend.info.instance_id, reason="restarted")

    async def _recheck(self, backend_id: str, backend: _Backend) -> None:
        """A backend dropped for timeouts: once it answers as the same instance, it registers
        again (with the rates it had); any other answer means it is gone or re-registers itself."""
        try:
            instance_id = await self._ping(backend)
        except asyncio.TimeoutError:
            return
        except Exception:
            self._silent.pop(backend_id, None)
            return
        self._silent.pop(backend_id, None)
        if instance_id == backend.info.instance_id and backend_id not in self.backends:
            logger.warning("router: backend %s answers health checks again; asking it to re-register", backend_id)
            try:
                await asyncio.wait_for(_await_ref(backend.handle.register.remote(self.known_rates.get(backend_id))),
                                       timeout=self._health_timeout_s)
            except Exception:  # it stays out; a later ping that answers asks again
                logger.warning("router: backend %s did not re-register", backend_id, exc_info=True)
                self._silent.setdefault(backend_id, backend)

    async def ping(self) -> bool:
        return True


async def _await_ref(ref: Any) -> Any:
    return await ref
