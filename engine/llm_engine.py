"""The engine a backend owns: add requests, step, stream outputs, abort.

`step()` is the whole loop body, in nano-vllm's shape: schedule, run the model, update request
state, turn new tokens into text and outputs. With asynchronous scheduling (the default on
cuda) a step call schedules and launches step N+1 first and only then waits for step N's
sampled ids and turns them into outputs, so the host's per-request Python runs while the GPU
computes; each call still returns the outputs of one forward, one call later.

The engine holds the loop and the parts it drives, each in its own module along the seams of a
request's life:
- admission (engine/admission.py): what only the engine can check about a request (an empty
  prompt, token ids outside its vocabulary, a prompt over its context, a request larger than
  its whole cache, a grammar that does not compile) is rejected in `add_request` with an
  `InvalidRequestError` naming the problem, so nothing bad ever reaches the step loop. The
  sampling settings are the request contract's, checked once by the edge that built the
  request (engine/sampling_params.py says where), not again here;
- n > 1 requests (engine/request_groups.py): n child requests that stand as one outside;
- output processing (engine/output_processor.py): sampled ids into outputs, stops,
  detokenizing, logprobs, and the end of a request that faulted on its own;
- reporting (engine/reporting.py): stats, request progress and prefix-cache changes, read
  between steps.

Should one request still fault while stepping (its grammar, its logits processing or
sampling, its detokenizer or stop handling), that request alone ends: its last output is
finished with the finish reason "error" (`FINISH_REASON_ERROR`; the HTTP ingress turns it into
an error response, or an error event on a stream that started), its blocks are freed, the
fault is logged under its id, and every other request goes on as if it had not been there. A
failure that no one request explains (the batched forward, a device error) raises out of
`step()` as before. `fault_injector` is a hook for tests: `fault_injector(point, req_id)` is
called at each named point below and may raise; None (the default) costs nothing.

- "sampling_row": as a request's sampling row is prepared for a step (it leaves that step);
- "logits", "grammar_bitmask": in the sampler, per row (engine/sampler.py);
- "grammar_accept": as a request's grammar accepts its sampled token;
- "output": as a request's sampled token becomes its output (stops, detokenizing);
- "step": once per launch, with req_id None, just before the batched forward: not any one
  request's, so it raises out of `step()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tandem.engine.admission import Admission, RequestLimits
from tandem.engine.config import EngineConfig, default_async_scheduling
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, StepShape, activation_bytes, kv_cache_bytes
from tandem.engine.model.loader import LoadedModel, load_model, load_model_meta
from tandem.engine.model_runner import ModelRunner, StepHandle
from tandem.engine.output_processor import FINISH_REASON_ERROR, OutputProcessor
from tandem.engine.outputs import EngineStats, RequestOutput, RequestProgress
from tandem.engine.request import Request
from tandem.engine.request_groups import RequestGroups, child_requests
from tandem.engine.reporting import CacheChanges, EngineReporter
from tandem.engine.sampler import SamplingRow
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.engine.sim_runner import SIM_DEVICE, ReloadTime, SimModelRunner, StepTime, sim_token_space
from tandem.engine.structured_output import GrammarCompiler
from tandem.engine.tokenizer import encode_chat, encode_prompt

MAX_DEFAULT_MODEL_LEN = 8192

logger = logging.getLogger("tandem.engine")

__all__ = ["FINISH_REASON_ERROR", "MAX_DEFAULT_MODEL_LEN", "LLMEngine"]


@dataclass
class _InFlight:
    """A launched step whose sampled ids have not been read yet."""

    handle: StepHandle
    pending: list[tuple[Request, int]]  # (request, output index) per sampled id, in order
    num_prefill: int
    num_decode: int
    start: float  # perf_counter() when its launch began
    has_grammar: bool = False  # a row's next mask needs this step's token (see `step`)


def _resolved(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with `cpu_kernels="auto"` resolved to what runs here (ggml_kernels.auto_kernels), said
    in one start-up line: a reader of the log learns which kernels run and why."""
    if cfg.cpu_kernels != "auto":
        return cfg
    from tandem.engine.model.ggml_kernels import auto_kernels

    kernels, why = auto_kernels(cfg)
    if cfg.device_type == "cpu":
        # warning: shown under Python's default log level, once per engine
        logger.warning("cpu engine: %s, kernels auto (%s)", cfg.dtype if cfg.dtype != "auto" else "float32", why)
    return replace(cfg, cpu_kernels=kernels)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, step_time: StepTime | None = None,
                 reload_time: ReloadTime | None = None, **overrides) -> None:
        """`step_time` times the steps of a `sim` device (engine/sim_runner.py), and `reload_time`
        its host KV tier's reloads (without one a sim engine has no host tier); other devices run
        the model and take neither."""
        self.config = _resolved(config or EngineConfig(**overrides))
        cfg = self.config
        self.is_sim = cfg.device_type == SIM_DEVICE
        if self.is_sim != (step_time is not None):
            raise ValueError("a sim device needs a step_time model, and only a sim device takes one")
        if reload_time is not None and not self.is_sim:
            raise ValueError("only a sim device takes a reload_time model")
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.device = torch.device("cpu" if self.is_sim else cfg.device)  # a sim's few tensors live on the host
        self.device_kind = cfg.device_type
        self.dtype = cfg.torch_dtype
        if self.is_sim:
            loaded = load_model_meta(cfg.model)
        else:
            loaded = load_model(cfg.model, self.device, self.dtype, quantization=cfg.weight_quantization,
                                kernels=cfg.cpu_kernels)
        self.model_name = loaded.name
        self.model_config = loaded.model_config
        self.eos_token_ids = tuple(loaded.model_config.eos_token_ids)
        self.max_model_len = min(loaded.model_config.max_position_embeddings,
                                 cfg.max_model_len or MAX_DEFAULT_MODEL_LEN)
        # KV bytes of one block (all layers, K and V): what sizes the caches, and what one tier copy moves
        self.kv_block_bytes = ModelRunner.kv_bytes_per_block(self.model_config, cfg.block_size, self.dtype)
        num_blocks = self._num_kv_blocks()
        num_host_blocks = self._num_kv_host_blocks(reload_time)
        self.max_active_limit = cfg.max_active  # what the KV pool and CUDA graphs were sized for
        # The runner first: the host tier the KV cache manager indexes is what the runner could allocate.
        self.model_runner = self._make_model_runner(loaded, num_blocks, num_host_blocks, step_time, reload_time)
        cache_changes = CacheChanges()
        self.kv_cache_manager = KVCacheManager(num_blocks, cfg.block_size, on_change=cache_changes.on_change,
                                               num_host_blocks=self.model_runner.num_host_blocks,
                                               offload_min_hits=cfg.kv_host_offload_min_hits)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_active, cfg.resolved_max_num_batched_tokens, cfg.block_size, num_blocks,
                            cfg.max_priority_wait_s),
            self.kv_cache_manager,
        )
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else default_async_scheduling(self.device_kind))
        self.grammar_compiler = GrammarCompiler(
            loaded.tokenizer, loaded.sampling_vocab_size or self.model_config.vocab_size, self.eos_token_ids)
        self._make_parts(loaded.tokenizer, cache_changes)
        self._in_flight: _InFlight | None = None
        self._pending_outputs: list[RequestOutput] = []  # aborts' last outputs, for the next step
        self._fault_injector: Callable[[str, str | None], None] | None = None

    def _make_model_runner(self, loaded: LoadedModel, num_blocks: int, num_host_blocks: int,
                           step_time: StepTime | None, reload_time: ReloadTime | None) -> ModelRunner | SimModelRunner:
        cfg = self.config
        if self.is_sim:
            return SimModelRunner(step_time, sim_token_space(loaded), reload_time, cfg.block_size, num_host_blocks)
        return ModelRunner(loaded, self.device, self.dtype, num_blocks, cfg.block_size, cfg.attention_backend,
                           cfg.max_active, self.max_model_len, cfg.enforce_eager, cfg.pack_cpu_weights,
                           cfg.resolved_max_num_batched_tokens, cfg.cpu_compile,
                           ggml_graph=cfg.cpu_kernels == "ggml-graph", num_host_blocks=num_host_blocks)

    def _make_parts(self, tokenizer: Any, cache_changes: CacheChanges) -> None:
        """The parts along a request's life (module doc). `changed` is the requests whose progress
        changed since the last report: each part marks what it moves, the reporter drains it."""
        changed: dict[str, Request] = {}
        self.request_groups = RequestGroups(self.scheduler, changed)
        self.output_processor = OutputProcessor(self.scheduler, self.request_groups, changed)
        limits = RequestLimits(self.model_config.vocab_size, self.max_model_len, self.config.block_size,
                               self.kv_cache_manager.num_usable_blocks)
        self.admission = Admission(limits, tokenizer, self.eos_token_ids, self.grammar_compiler, self.device,
                                   self.is_sim, self.output_processor.tracked)
        self.reporter = EngineReporter(self.scheduler, self.kv_cache_manager, self.request_groups, cache_changes,
                                       changed)
        if self.kv_cache_manager.host_tier is not None:  # the tier's byte rates
            self.reporter.stats.kv_block_bytes = self.kv_block_bytes

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: prompts are encoded, and new requests detokenized, with it."""
        return self.admission.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.admission.tokenizer = tokenizer

    @property
    def fault_injector(self) -> Callable[[str, str | None], None] | None:
        """A test's hook, `fault_injector(point, req_id)`, called at the named points (module
        doc) and free to raise there; None in service."""
        return self._fault_injector

    @fault_injector.setter
    def fault_injector(self, injector: Callable[[str, str | None], None] | None) -> None:
        self._fault_injector = injector
        self.output_processor.fault_injector = injector
        self.model_runner.sampler.fault_injector = injector

    # -- sizing ------------------------------------------------------------------------------
    @property
    def num_kv_tokens(self) -> int:
        """Tokens the KV cache holds (the null block excluded)."""
        return (len(self.kv_cache_manager.block_pool.blocks) - 1) * self.config.block_size

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        kv_bytes = self._kv_bytes_from_share() if cfg.kv_cache_from_share else cfg.resolved_kv_cache_bytes
        by_memory = kv_bytes // self.kv_block_bytes
        # Enough for every active request at full context, four times over for the prefix
        # cache; more only costs memory and Python objects.
        by_need = 4 * cfg.max_active * cdiv(self.max_model_len, cfg.block_size)
        return int(min(by_memory, by_need)) + 1  # + the null block

    def _num_kv_host_blocks(self, reload_time: ReloadTime | None) -> int:
        """The host KV tier's blocks (0: none). A sim engine has one only with a reload rate."""
        cfg = self.config
        if not (cfg.kv_host_blocks or cfg.kv_host_memory_gb):
            return 0
        if self.is_sim and reload_time is None:
            logger.warning("sim engine: no host reload rate (host_reload_tok_s) in its profile, so no host KV tier")
            return 0
        return cfg.resolved_kv_host_blocks(self.kv_block_bytes)

    def _kv_bytes_from_share(self) -> int:
        """The KV cache a cuda engine gets from its share of the device (engine/memory.py),
        measured now that its weights are on the device."""
        cfg, mc = self.config, self.model_config
        free, total = torch.cuda.mem_get_info(self.device)
        shape = StepShape(mc.hidden_size, mc.intermediate_size, mc.q_size, mc.kv_size, mc.vocab_size,
                          cfg.resolved_max_num_batched_tokens, cfg.max_active, self.dtype.itemsize)
        share = cfg.gpu_memory_share or DEFAULT_GPU_MEMORY_UTILIZATION
        return kv_cache_bytes(total, free, share, torch.cuda.memory_allocated(self.device),
                              activation_bytes(shape), strict=cfg.gpu_memory_share is not None)

    # -- requests ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def add_request(self, req_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> int:
        """Queue a request; returns its number of prompt tokens. n > 1 queues a group."""
        if req_id in self.scheduler.requests or req_id in self.request_groups:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.admission.check(token_ids, params)
        if params.n > 1:
            self.request_groups.add(req_id, [self.admission.new_request(child_id, token_ids, child_params, arrival_time)
                                             for child_id, child_params in child_requests(req_id, params)])
        else:
            request = self.admission.new_request(req_id, token_ids, params, arrival_time)
            self.scheduler.add_request(request)
            self.reporter.changed[req_id] = request
        return len(token_ids)

    def abort_request(self, req_id: str) -> bool:
        """End a request (every choice of a group); its last output comes with the next step."""
        output = self.request_groups.abort(req_id, self.output_processor.tracked)
        if output is None:
            output = self.output_processor.abort(req_id)
        if output is None:
            return False
        self._pending_outputs.append(output)
        return True

    def set_max_active(self, max_active: int) -> None:
        """Change how many requests may run at once (a benchmark sweeps it on one engine). It
        cannot exceed the limit the engine was built with, which sized the CUDA graphs."""
        if not 1 <= max_active <= self.max_active_limit:
            raise ValueError(f"max_active must be in [1, {self.max_active_limit}] "
                             f"(the engine was built for {self.max_active_limit}); got {max_active}")
        self.config.max_active = max_active
        self.scheduler.config.max_active = max_active

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)
                or self._in_flight is not None or bool(self.output_processor.failed_outputs))

    def num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """Prefix-cache hit for this prompt right now; changes no cache state (router query)."""
        return self.kv_cache_manager.num_cached_tokens(prompt_token_ids)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._in_flight is not None and self._in_flight.has_grammar:
            # A grammar's next mask needs the token the running step samples: wait for it
            # (steps without grammar rows keep the asynchronous path).
            outputs.extend(self._finish(self._in_flight))
            self._in_flight = None
        sched = self.scheduler.schedule()
        if sched.is_empty:  # its KV copies still run: the caches' indexes already count them done
            self.model_runner.apply_kv_transfers(sched.kv_transfers)
        launched = None if sched.is_empty else self._launch(sched)
        if self._in_flight is not None:  # the previous step ran while this one was planned
            outputs.extend(self._finish(self._in_flight))
            self._in_flight = None
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                outputs.extend(self._finish(launched))
        if self.output_processor.failed_outputs:  # last: nothing of a failed request follows its final output
            outputs.extend(self.output_processor.take_failed_outputs())
        return outputs

    def _launch(self, sched) -> _InFlight | None:
        """Enqueue the step on the device, then advance request state past it (placeholders).
        None if every request left the step (each failed preparing its sampling row)."""
        start = time.perf_counter()
        rows, failed = self._sampling_rows(sched)
        if failed:
            sched = self._without_failed(sched, failed)
            if sched.is_empty:
                self.model_runner.apply_kv_transfers(sched.kv_transfers)
                return None
        num_decode = sched.num_decode_tokens
        num_prefill = sched.num_scheduled_tokens - num_decode
        if self._fault_injector is not None:
            self._fault_injector("step", None)
        sampler = self.model_runner.sampler
        handle = self.model_runner.launch(sched, self.kv_cache_manager, rows)
        pending = self.scheduler.advance(sched)
        changed = self.reporter.changed
        for s in sched.scheduled:
            changed[s.request.req_id] = s.request
        if sampler.failures:  # rows that failed on their own: their requests end, the step goes on
            failures, sampler.failures = sampler.failures, []
            in_step = {s.request.req_id: s.request for s in sched.scheduled}
            for row, exc, point in failures:
                if row.req_id in in_step:
                    self.output_processor.fail(in_step[row.req_id], exc, point)
        has_grammar = any(row.grammar is not None for row in rows.values())
        return _InFlight(handle, pending, num_prefill, num_decode, start, has_grammar)

    def _sampling_rows(self, sched) -> tuple[dict[str, SamplingRow], list[tuple[Request, Exception]] | None]:
        """The sampling row of each request this step samples, and the requests whose row failed."""
        inject = self._fault_injector
        rows, failed = {}, None
        for s in sched.scheduled:
            if s.completes_prefill:
                request = s.request
                try:
                    if inject is not None:
                        inject("sampling_row", request.req_id)
                    rows[request.req_id] = self._sampling_row(request)
                except Exception as exc:
                    failed = failed or []
                    failed.append((request, exc))
        return rows, failed

    def _sampling_row(self, request: Request) -> SamplingRow:
        row = self.output_processor.tracked[request.req_id].sampling_row
        params = request.sampling_params
        if params.min_tokens:
            under_min = request.num_output_tokens < params.min_tokens
            row.banned_token_ids = (*self.eos_token_ids, *params.stop_token_ids) if under_min else ()
        return row

    def _without_failed(self, sched, failed: list[tuple[Request, Exception]]):
        """The step without the requests whose sampling rows failed (each ends with an error
        output and frees its blocks, including those just allocated for this step)."""
        for request, exc in failed:
            self.output_processor.fail(request, exc, "sampling_row")
        gone = {request.req_id for request, _ in failed}
        return replace(sched, scheduled=[s for s in sched.scheduled if s.request.req_id not in gone])

    def _finish(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's sampled ids and turn them into outputs."""
        wait_start = time.perf_counter()
        tokens = step.handle.tokens()
        self.reporter.record_step(step.num_prefill, step.num_decode, step.start, time.perf_counter() - wait_start)
        processor = self.output_processor
        if step.has_grammar:
            processor.advance_grammars(step.pending, tokens)
        outputs = processor.process_outputs(step.pending, tokens)
        logprobs = step.handle.logprobs()
        if logprobs:
            processor.attach_logprobs(outputs, logprobs, step.pending)
        return self.request_groups.group_outputs(outputs)

    # -- reports -----------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.reporter.get_stats()

    def cached_block_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now (a snapshot for a new mirror)."""
        return list(self.kv_cache_manager.block_pool.cached_blocks)

    def drain_cache_changes(self) -> dict[int, int]:
        """Block hashes whose tier changed since the last call, latest state per hash: 1 held on
        the device (published), 2 held only in the host KV tier, 0 held nowhere (1 and 0 are the
        True and False of a cache without a host tier). Applied in order to a snapshot, they let
        a router mirror this cache's index and answer prefix-hit queries without a round trip to
        this engine."""
        return self.reporter.cache_changes.drain()

    def drain_progress(self) -> list[RequestProgress]:
        """State of every request that changed since the last call, as absolute counts (so a
        late or repeated report is harmless). After a cache eviction, waiting requests are
        re-reported with their current prefix hit in `num_cached_tokens`."""
        return self.reporter.drain_progress()
