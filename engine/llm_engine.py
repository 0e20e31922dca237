"""The engine a backend owns: add requests, step, stream outputs, abort.

`step()` is the whole loop body, in nano-vllm's shape: schedule, run the model, update request
state, turn new tokens into text and outputs. With asynchronous scheduling (the default on
cuda) a step call schedules and launches step N+1 first and only then waits for step N's
sampled ids and turns them into outputs, so the host's per-request Python runs while the GPU
computes; each call still returns the outputs of one forward, one call later. What only the
engine can check about a request (an empty prompt, token ids outside its vocabulary, a prompt
over its context, a request larger than its whole cache, a grammar that does not compile) is
rejected in `add_request` with an `InvalidRequestError` naming the problem, so nothing bad
ever reaches the step loop. The sampling settings are the request contract's, checked once by
the edge that built the request (engine/sampling_params.py says where), not again here.

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

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, StepShape, activation_bytes, kv_cache_bytes
from tandem.engine.model.loader import load_model, load_model_meta
from tandem.engine.model_runner import ModelRunner, StepHandle
from tandem.engine.outputs import EngineStats, RequestOutput, RequestProgress, Usage
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import SamplingRow
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.engine.sim_runner import SIM_DEVICE, SimModelRunner, StepTime, sim_token_space
from tandem.engine.structured_output import GrammarCompiler, RequestGrammar
from tandem.engine.tokenizer import encode_chat, encode_prompt

MAX_DEFAULT_MODEL_LEN = 8192
FINISH_REASON_ERROR = "error"  # the last output of a request that failed on its own (see above)

logger = logging.getLogger("tandem.engine")


@dataclass
class _InFlight:
    """A launched step whose sampled ids have not been read yet."""

    handle: StepHandle
    pending: list[tuple[Request, int]]  # (request, output index) per sampled id, in order
    num_prefill: int
    num_decode: int
    start: float  # perf_counter() when its launch began
    has_grammar: bool = False  # a row's next mask needs this step's token (see `step`)


@dataclass
class _Group:
    """A request with n > 1: n child requests (`{req_id}#{i}`) that share its prompt. Child 0
    enters the scheduler at once and the others once it has produced its first token, so its
    prompt's full blocks are in the prefix cache and the others compute only the last partial
    block: the prompt is prefilled once."""

    req_id: str
    children: list[Request]
    completion_tokens: list[int]
    num_added: int = 1
    num_finished: int = 0
    cached_tokens: int = 0


@dataclass
class _Tracked:
    """Per-request engine-side state that the torch-free scheduler does not hold."""

    detokenizer: IncrementalDetokenizer
    sampling_row: SamplingRow


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
    def __init__(self, config: EngineConfig | None = None, step_time: StepTime | None = None, **overrides) -> None:
        """`step_time` times the steps of a `sim` device (engine/sim_runner.py); other devices run
        the model and take none."""
        self.config = _resolved(config or EngineConfig(**overrides))
        cfg = self.config
        self.is_sim = cfg.device_type == SIM_DEVICE
        if self.is_sim != (step_time is not None):
            raise ValueError("a sim device needs a step_time model, and only a sim device takes one")
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
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.model_config
        self.eos_token_ids = tuple(loaded.model_config.eos_token_ids)
        self.max_model_len = min(loaded.model_config.max_position_embeddings,
                                 cfg.max_model_len or MAX_DEFAULT_MODEL_LEN)
        num_blocks = self._num_kv_blocks()
        self.max_active_limit = cfg.max_active  # what the KV pool and CUDA graphs were sized for
        self._evicted = False
        self._cache_changes: dict[int, bool] = {}
        self.kv_cache_manager = KVCacheManager(num_blocks, cfg.block_size, on_evict=self._on_evict,
                                               on_publish=self._on_publish)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_active, cfg.resolved_max_num_batched_tokens, cfg.block_size, num_blocks,
                            cfg.max_priority_wait_s),
            self.kv_cache_manager,
        )
        if self.is_sim:
            self.model_runner = SimModelRunner(step_time, sim_token_space(loaded))
        else:
            self.model_runner = ModelRunner(loaded, self.device, self.dtype, num_blocks, cfg.block_size,
                                            cfg.attention_backend, cfg.max_active, self.max_model_len,
                                            cfg.enforce_eager, cfg.pack_cpu_weights,
                                            cfg.resolved_max_num_batched_tokens, cfg.cpu_compile,
                                            ggml_graph=cfg.cpu_kernels == "ggml-graph")
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else self.device_kind in ("cuda", SIM_DEVICE))
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, loaded.sampling_vocab_size or self.model_config.vocab_size, self.eos_token_ids)
        self._in_flight: _InFlight | None = None
        self._last_finish = 0.0
        self._tracked: dict[str, _Tracked] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._changed: dict[str, Request] = {}
        self._stats = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0)
        self._groups: dict[str, _Group] = {}  # n > 1 requests by id
        self._child_of: dict[str, tuple[_Group, int]] = {}  # child req_id -> (its group, its index)
        self._failed_outputs: list[RequestOutput] = []  # requests that failed in this step (`_fail`)
        self._fault_injector: Callable[[str, str | None], None] | None = None

    @property
    def fault_injector(self) -> Callable[[str, str | None], None] | None:
        """A test's hook, `fault_injector(point, req_id)`, called at the named points (module
        doc) and free to raise there; None in service."""
        return self._fault_injector

    @fault_injector.setter
    def fault_injector(self, injector: Callable[[str, str | None], None] | None) -> None:
        self._fault_injector = injector
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
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, cfg.block_size, self.dtype)
        kv_bytes = self._kv_bytes_from_share() if cfg.kv_cache_from_share else cfg.resolved_kv_cache_bytes
        by_memory = kv_bytes // per_block
        # Enough for every active request at full context, four times over for the prefix
        # cache; more only costs memory and Python objects.
        by_need = 4 * cfg.max_active * cdiv(self.max_model_len, cfg.block_size)
        return int(min(by_memory, by_need)) + 1  # + the null block

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

    def _on_evict(self, block_hash: int) -> None:
        self._evicted = True
        self._cache_changes[block_hash] = False

    def _on_publish(self, block_hash: int) -> None:
        self._cache_changes[block_hash] = True

    # -- requests ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def add_request(self, req_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> int:
        """Queue a request; returns its number of prompt tokens."""
        if req_id in self.scheduler.requests or req_id in self._groups:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(token_ids, params)
        if self.is_sim:
            SimModelRunner.check_request(params.logprobs, params.structured_output is not None)
        if params.n > 1:
            self._add_group(req_id, token_ids, params, arrival_time)
            return len(token_ids)
        self.scheduler.add_request(self._new_request(req_id, token_ids, params, arrival_time))
        self._changed[req_id] = self.scheduler.requests[req_id]
        return len(token_ids)

    def _add_group(self, req_id: str, token_ids: list[int], params: SamplingParams,
                   arrival_time: float | None) -> None:
        """n child requests, seeded seed, seed + 1, ... when seeded so the choices differ."""
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            child = self._new_request(f"{req_id}#{i}", token_ids, replace(params, n=1, seed=seed), arrival_time)
            children.append(child)
        group = _Group(req_id, children, [0] * params.n)
        self._groups[req_id] = group
        for i, child in enumerate(children):
            self._child_of[child.req_id] = (group, i)
        self.scheduler.add_request(children[0])
        self._changed[children[0].req_id] = children[0]

    def _new_request(self, req_id: str, token_ids: list[int], params: SamplingParams,
                     arrival_time: float | None) -> Request:
        """A request and its engine-side state, not yet in the scheduler."""
        grammar = self._make_grammar(params)
        request = Request(req_id, token_ids, params, self.eos_token_ids, arrival_time)
        self._tracked[req_id] = _Tracked(
            IncrementalDetokenizer(self.tokenizer, token_ids, params.stop),
            SamplingRow(params, self._make_generator(params.seed), grammar=grammar,
                        prompt_token_ids=token_ids if params.repetition_penalty != 1.0 else [], req_id=req_id),
        )
        return request

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # C loops: a genexpr cost ~0.2 ms per 1k tokens
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{total} tokens, over this model's context length of {self.max_model_len}")
        num_blocks = cdiv(total, self.config.block_size)
        if num_blocks > self.kv_cache_manager.num_usable_blocks:
            raise InvalidRequestError(
                f"the request needs {num_blocks} KV blocks but the whole cache has "
                f"{self.kv_cache_manager.num_usable_blocks}; lower max_tokens or the prompt")

    def _make_grammar(self, params: SamplingParams) -> RequestGrammar | None:
        """The request's grammar matcher; compile errors are the request's fault (a 400)."""
        if params.structured_output is None:
            return None
        return self.grammar_compiler.make_grammar(params.structured_output)

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def abort_request(self, req_id: str) -> bool:
        group = self._groups.pop(req_id, None)
        if group is not None:
            self._abort_group(group)
            return True
        request = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return False
        self._pending_outputs.append(self._make_output(request, [], ""))
        self._tracked.pop(req_id, None)
        self._changed[req_id] = request
        return True

    def _abort_group(self, group: _Group) -> None:
        """Abort every choice; one last output, finished, reports the request's usage so far."""
        for child in group.children:
            if self.scheduler.finish_request(child.req_id, RequestStatus.FINISHED_ABORTED) is None:
                if not child.is_finished:  # not in the scheduler yet
                    child.status = RequestStatus.FINISHED_ABORTED
            self._tracked.pop(child.req_id, None)
            self._changed[child.req_id] = child
        group.num_finished = len(group.children)
        first = group.children[0]
        self._pending_outputs.append(RequestOutput(
            group.req_id, [], "", True, "abort",
            Usage(first.num_prompt_tokens, sum(c.num_resolved_output_tokens for c in group.children),
                  max(first.num_cached_tokens, 0)),
            first.arrival_time, first.first_scheduled_time, first.first_token_time, first.finished_time))

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
                or self._in_flight is not None or bool(self._failed_outputs))

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
        launched = None if sched.is_empty else self._launch(sched)
        if self._in_flight is not None:  # the previous step ran while this one was planned
            outputs.extend(self._finish(self._in_flight))
            self._in_flight = None
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                outputs.extend(self._finish(launched))
        if self._failed_outputs:  # last: nothing of a failed request follows its final output
            outputs.extend(self._take_failed_outputs())
        return outputs

    def _launch(self, sched) -> _InFlight | None:
        """Enqueue the step on the device, then advance request state past it (placeholders).
        None if every request left the step (each failed preparing its sampling row)."""
        start = time.perf_counter()
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
        if failed:
            sched = self._without_failed(sched, failed)
            if sched.is_empty:
                return None
        num_decode = sched.num_decode_tokens
        num_prefill = sched.num_scheduled_tokens - num_decode
        if inject is not None:
            inject("step", None)
        sampler = self.model_runner.sampler
        handle = self.model_runner.launch(sched, self.kv_cache_manager, rows)
        pending = self.scheduler.advance(sched)
        changed = self._changed
        for s in sched.scheduled:
            changed[s.request.req_id] = s.request
        if sampler.failures:  # rows that failed on their own: their requests end, the step goes on
            failures, sampler.failures = sampler.failures, []
            in_step = {s.request.req_id: s.request for s in sched.scheduled}
            for row, exc, point in failures:
                if row.req_id in in_step:
                    self._fail(in_step[row.req_id], exc, point)
        has_grammar = any(row.grammar is not None for row in rows.values())
        return _InFlight(handle, pending, num_prefill, num_decode, start, has_grammar)

    def _without_failed(self, sched, failed: list[tuple[Request, Exception]]):
        """The step without the requests whose sampling rows failed (each ends with an error
        output and frees its blocks, including those just allocated for this step)."""
        for request, exc in failed:
            self._fail(request, exc, "sampling_row")
        gone = {request.req_id for request, _ in failed}
        return replace(sched, scheduled=[s for s in sched.scheduled if s.request.req_id not in gone])

    def _fail(self, request: Request, exc: BaseException, point: str, num_kept: int | None = None) -> None:
        """End one request that faulted on its own at `point`: free its blocks, keep its first
        `num_kept` outputs (default: those known on the host) and queue its last output, finished
        with reason "error", for the end of this step. A request already gone is left alone."""
        req_id = request.req_id
        if self._tracked.pop(req_id, None) is None:
            return  # finished, aborted or failed already
        logger.error("request %s failed in the engine (%s); it ends with an error, the others go on",
                     req_id, point, exc_info=exc)
        if self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED) is None:
            request.status = RequestStatus.FINISHED_ABORTED  # finished at launch (max_tokens): drop its last token
            if request.finished_time is None:
                request.finished_time = time.time()
        request.truncate_outputs(request.num_resolved_output_tokens if num_kept is None else num_kept)
        request.num_pending_tokens = 0  # its tokens still on the device are dropped when they land
        self._changed[req_id] = request
        self._failed_outputs.append(RequestOutput(
            req_id, [], "", True, FINISH_REASON_ERROR,
            Usage(request.num_prompt_tokens, request.num_output_tokens, max(request.num_cached_tokens, 0)),
            request.arrival_time, request.first_scheduled_time, request.first_token_time, request.finished_time))

    def _take_failed_outputs(self) -> list[RequestOutput]:
        outputs, self._failed_outputs = self._failed_outputs, []
        if self._child_of:
            outputs = [self._group_output(out) if out.req_id in self._child_of else out for out in outputs]
        return outputs

    def _finish(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's sampled ids and turn them into outputs."""
        tokens = step.handle.tokens()
        now = time.perf_counter()
        # The step's share of the wall: from its launch, or from the previous step's end when
        # it was launched while that one ran.
        self._record_step(step.num_prefill, step.num_decode, now - max(step.start, self._last_finish))
        self._last_finish = now
        if step.has_grammar:
            self._advance_grammars(step.pending, tokens)
        outputs = self._process_outputs(step.pending, tokens)
        logprobs = step.handle.logprobs()
        if logprobs:
            self._attach_logprobs(outputs, logprobs, step.pending)
        if self._child_of:
            outputs = [self._group_output(out) if out.req_id in self._child_of else out for out in outputs]
        return outputs

    @staticmethod
    def _attach_logprobs(outputs: list[RequestOutput], logprobs: dict[int, tuple],
                         pending: list[tuple[Request, int]]) -> None:
        """Each output's token's logprobs (a request samples at most one token a step)."""
        by_req_id = {pending[row][0].req_id: entry for row, entry in logprobs.items()}
        for out in outputs:
            entry = by_req_id.get(out.req_id)
            if entry is not None:
                out.logprobs = [entry]

    def _group_output(self, out: RequestOutput) -> RequestOutput:
        """A child's output as its group's: the group's id, the child's index, the group's usage,
        and `finished` only once every choice is. Child 0's first token admits the others."""
        group, index = self._child_of[out.req_id]
        group.completion_tokens[index] = out.usage.completion_tokens
        if index == 0:
            group.cached_tokens = out.usage.cached_tokens
            while group.num_added < len(group.children):
                child = group.children[group.num_added]
                group.num_added += 1
                if not child.is_finished:
                    self.scheduler.add_request(child)
                    self._changed[child.req_id] = child
        if out.finished:
            group.num_finished += 1
            self._changed[out.req_id] = group.children[index]  # its progress turns "finished" now
        done = group.num_finished == len(group.children)
        if done:
            self._groups.pop(group.req_id, None)
        return replace(out, req_id=group.req_id, index=index, finished=done,
                       usage=Usage(out.usage.prompt_tokens, sum(group.completion_tokens), group.cached_tokens))

    def _advance_grammars(self, pending: list[tuple[Request, int]], tokens: list[int]) -> None:
        """Each grammar row accepts its sampled token; a grammar that is complete (its EOS
        accepted, even under ignore_eos) or that refuses the token stops its request there. A
        grammar that raises fails its request alone."""
        inject = self._fault_injector
        for (request, index), token in zip(pending, tokens):
            if request.status is RequestStatus.FINISHED_ABORTED or index >= len(request.output_token_ids):
                continue
            grammar = self._tracked[request.req_id].sampling_row.grammar
            if grammar is None:
                continue
            try:
                if inject is not None:
                    inject("grammar_accept", request.req_id)
                if not grammar.accept_token(token) or grammar.is_terminated():
                    self._stop(request, index)
            except Exception as exc:
                self._fail(request, exc, "grammar_accept", num_kept=index)

    def _sampling_row(self, request: Request) -> SamplingRow:
        row = self._tracked[request.req_id].sampling_row
        params = request.sampling_params
        if params.min_tokens:
            under_min = request.num_output_tokens < params.min_tokens
            row.banned_token_ids = (*self.eos_token_ids, *params.stop_token_ids) if under_min else ()
        return row

    def _process_outputs(self, pending: list[tuple[Request, int]], tokens: list[int]) -> list[RequestOutput]:
        """Fill in each sampled token, apply token-level stops, detokenize and check stop
        strings, build the outputs. This is per-request Python on every step (hundreds of
        requests at high concurrency, while the GPU runs the next step), so it reads each value
        once and inlines the common path. A request aborted or stopped after the step was
        launched drops its token. A request whose processing raises fails alone (`_fail`),
        without this token."""
        outputs = []
        append = outputs.append
        now = time.time()
        tracked_by_id = self._tracked
        aborted = RequestStatus.FINISHED_ABORTED
        inject = self._fault_injector
        for (request, index), token in zip(pending, tokens):
            output_ids = request.output_token_ids
            if request.status is aborted or index >= len(output_ids):
                continue
            try:  # free unless it raises (Python 3.11's zero-cost exceptions)
                if inject is not None:
                    inject("output", request.req_id)
                output_ids[index] = token  # resolve the placeholder
                prompt_len = len(request.prompt_token_ids)
                request.all_token_ids[prompt_len + index] = token
                request.num_pending_tokens -= 1
                if request.first_token_time is None:
                    request.first_token_time = now
                if (token in request.stop_token_set
                        and request.stop_status(token, index + 1) is RequestStatus.FINISHED_STOPPED):
                    self._stop(request, index)
                req_id = request.req_id
                tracked = tracked_by_id[req_id]
                new_token_ids = [token]
                detokenizer = tracked.detokenizer
                if detokenizer.add_tokens(new_token_ids):
                    self._stop(request, index)  # also on the max_tokens token: the stop string wins
                status = request.status
                finished = status.is_finished and not request.num_pending_tokens
                text = detokenizer.take_new_text(finished)
            except Exception as exc:
                self._fail(request, exc, "output", num_kept=index)
                continue
            if finished:
                request.finished_time = now
                del tracked_by_id[req_id]
                # Reported "running" while this token was on the device (finished at launch):
                # report it again, now finished, or the router counts it as load for ever.
                self._changed[req_id] = request
            append(RequestOutput(req_id, new_token_ids, text, finished, status.finish_reason if finished else None,
                                 Usage(prompt_len, len(output_ids) - request.num_pending_tokens,
                                       max(request.num_cached_tokens, 0)),
                                 request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                 request.finished_time))
        return outputs

    def _stop(self, request: Request, index: int) -> None:
        """Finish a request at output `index` (a stop token or string) and drop what was
        sampled after it."""
        if request.is_finished:  # finished at a later launch by max_tokens: it stopped first
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED)
        request.truncate_outputs(index + 1)

    def _make_output(self, request: Request, new_token_ids: list[int], text: str,
                     finished: bool | None = None) -> RequestOutput:
        finished = request.is_finished if finished is None else finished
        return RequestOutput(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            new_text=text,
            finished=finished,
            finish_reason=request.status.finish_reason if finished else None,
            usage=Usage(request.num_prompt_tokens, request.num_resolved_output_tokens,
                        max(request.num_cached_tokens, 0)),
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
        )

    # -- stats -------------------------------------------------------------------------------
    def _record_step(self, num_prefill: int, num_decode: int, elapsed: float) -> None:
        st = self._stats
        st.step_time_s = elapsed
        st.step_prefill_tokens = num_prefill
        st.step_decode_tokens = num_decode
        if num_prefill:
            st.prefill_time_s += elapsed
        else:
            st.decode_time_s += elapsed
        st.num_prompt_tokens_total += num_prefill
        st.num_generation_tokens_total += num_decode

    def get_stats(self) -> EngineStats:
        st, kv = self._stats, self.kv_cache_manager
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        st.num_free_blocks = kv.block_pool.get_num_free_blocks()
        st.num_total_blocks = kv.num_usable_blocks
        st.kv_cache_usage = kv.usage
        st.prefix_cache_queries = kv.prefix_cache_queries
        st.prefix_cache_hits = kv.prefix_cache_hits
        st.num_preemptions = self.scheduler.num_preemptions
        return st

    def cached_block_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now (a snapshot for a new mirror)."""
        return list(self.kv_cache_manager.block_pool.cached_blocks)

    def drain_cache_changes(self) -> dict[int, bool]:
        """Block hashes published (True) or evicted (False) since the last call, latest state
        per hash. Applied in order to a snapshot, they let a router mirror this cache's index
        and answer prefix-hit queries without a round trip to this engine."""
        changes, self._cache_changes = self._cache_changes, {}
        return changes

    def drain_progress(self) -> list[RequestProgress]:
        """State of every request that changed since the last call, as absolute counts (so a
        late or repeated report is harmless). After a cache eviction, waiting requests are
        re-reported with their current prefix hit in `num_cached_tokens`."""
        if self._evicted:
            self._evicted = False
            for request in self.scheduler.waiting:
                self._changed[request.req_id] = request
        progress, groups = [], {}
        child_of = self._child_of
        for req_id, request in self._changed.items():
            entry = child_of.get(req_id) if child_of else None
            if entry is None:
                progress.append(self._progress(request))
            else:
                groups[entry[0].req_id] = entry[0]
        self._changed = {}
        progress.extend(self._group_progress(group) for group in groups.values())
        return progress

    def _group_progress(self, group: _Group) -> RequestProgress:
        """A group as the router sees it: one prompt and n decode budgets. Once it finished,
        its children are forgotten."""
        children = [self._progress(c) for c in group.children]
        first = children[0]
        aborted = RequestStatus.FINISHED_ABORTED  # an aborted choice's last placeholder never resolves
        if all(p.status == "finished" or c.status is aborted for p, c in zip(children, group.children)):
            status = "finished"
            for child in group.children:
                self._child_of.pop(child.req_id, None)
        elif any(p.status == "running" for p in children):
            status = "running"
        else:
            status = first.status
        return RequestProgress(group.req_id, status, first.num_prompt_tokens, first.num_cached_tokens,
                               first.num_computed_prompt_tokens, sum(p.num_output_tokens for p in children),
                               sum(p.max_tokens for p in children))

    def _progress(self, request: Request) -> RequestProgress:
        if request.is_finished and not request.num_pending_tokens:
            status = "finished"
        elif request.is_finished:
            status = "running"  # its last token is still on the device
        else:
            status = request.status.value
        cached = request.num_cached_tokens
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            cached = self.kv_cache_manager.num_cached_tokens(request.all_token_ids)
        return RequestProgress(request.req_id, status, request.num_prompt_tokens, cached,
                               request.num_computed_prompt_tokens, request.num_resolved_output_tokens,
                               request.max_tokens)
