"""The engine a backend owns: add requests, step, stream outputs, abort.

`step()` is the whole loop body, in nano-vllm's shape: schedule, run the model, update request
state, turn new tokens into text and outputs. Everything a caller may get wrong (empty prompt,
a prompt over the context, a request larger than the whole cache, bad sampling settings) is
rejected in `add_request` with an `InvalidRequestError` naming the problem, so nothing bad
ever reaches the step loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.model.loader import load_model
from tandem.engine.model_runner import ModelRunner
from tandem.engine.outputs import EngineStats, RequestOutput, RequestProgress, Usage
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import SamplingRow
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig

MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class _Tracked:
    """Per-request engine-side state that the torch-free scheduler does not hold."""

    detokenizer: IncrementalDetokenizer
    sampling_row: SamplingRow


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.config = config or EngineConfig(**overrides)
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        loaded = load_model(cfg.model, self.device, self.dtype)
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
            SchedulerConfig(cfg.max_active, cfg.resolved_max_num_batched_tokens, cfg.block_size, num_blocks),
            self.kv_cache_manager,
        )
        self.model_runner = ModelRunner(loaded, self.device, self.dtype, num_blocks, cfg.block_size,
                                        cfg.attention_backend, cfg.max_active, self.max_model_len,
                                        cfg.enforce_eager, cfg.pack_cpu_weights)
        self._tracked: dict[str, _Tracked] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._changed: dict[str, Request] = {}
        self._stats = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0)

    # -- sizing ------------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, cfg.block_size, self.dtype)
        by_memory = cfg.resolved_kv_cache_bytes // per_block
        # Enough for every active request at full context, four times over for the prefix
        # cache; more only costs memory and Python objects.
        by_need = 4 * cfg.max_active * cdiv(self.max_model_len, cfg.block_size)
        return int(min(by_memory, by_need)) + 1  # + the null block

    def _on_evict(self, block_hash: int) -> None:
        self._evicted = True
        self._cache_changes[block_hash] = False

    def _on_publish(self, block_hash: int) -> None:
        self._cache_changes[block_hash] = True

    # -- requests ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def add_request(self, req_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> int:
        """Queue a request; returns its number of prompt tokens."""
        if req_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(token_ids, params)
        request = Request(req_id, token_ids, params, self.eos_token_ids, arrival_time)
        self._tracked[req_id] = _Tracked(
            IncrementalDetokenizer(self.tokenizer, token_ids, params.stop),
            SamplingRow(params, self._make_generator(params.seed)),
        )
        self.scheduler.add_request(request)
        self._changed[req_id] = request
        return len(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
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

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def abort_request(self, req_id: str) -> bool:
        request = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return False
        self._pending_outputs.append(self._make_output(request, [], ""))
        self._tracked.pop(req_id, None)
        self._changed[req_id] = request
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
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """Prefix-cache hit for this prompt right now; changes no cache state (router query)."""
        return self.kv_cache_manager.num_cached_tokens(prompt_token_ids)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        num_decode = sched.num_decode_tokens
        num_prefill = sched.num_scheduled_tokens - num_decode
        start = time.perf_counter()
        rows = {s.request.req_id: self._sampling_row(s.request) for s in sched.scheduled
                if s.completes_prefill}
        sampled = self.model_runner.execute(sched, self.kv_cache_manager, rows)
        progressed = self.scheduler.update_from_output(sched, sampled)
        self._record_step(num_prefill, num_decode, time.perf_counter() - start)
        for s in sched.scheduled:
            self._changed[s.request.req_id] = s.request
        outputs.extend(self._process_outputs(progressed))
        return outputs

    def _sampling_row(self, request: Request) -> SamplingRow:
        row = self._tracked[request.req_id].sampling_row
        params = request.sampling_params
        if params.min_tokens:
            under_min = request.num_output_tokens < params.min_tokens
            row.banned_token_ids = (*self.eos_token_ids, *params.stop_token_ids) if under_min else ()
        return row

    def _process_outputs(self, progressed: list[Request]) -> list[RequestOutput]:
        """Detokenize each request's new token, apply stop strings, build its output. This is
        per-request Python on every step, so it reads each value once."""
        outputs = []
        for request in progressed:
            req_id = request.req_id
            detokenizer = self._tracked[req_id].detokenizer
            new_token_ids = request.output_token_ids[-1:]
            if detokenizer.add_tokens(new_token_ids):
                if request.is_finished:  # hit max_tokens on the same token: the stop string wins
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req_id, RequestStatus.FINISHED_STOPPED)
            finished = request.is_finished
            text = detokenizer.take_new_text(finished)
            outputs.append(self._make_output(request, new_token_ids, text))
            if finished:
                del self._tracked[req_id]
        return outputs

    def _make_output(self, request: Request, new_token_ids: list[int], text: str) -> RequestOutput:
        return RequestOutput(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            usage=Usage(request.num_prompt_tokens, request.num_output_tokens,
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
        progress = [self._progress(r) for r in self._changed.values()]
        self._changed = {}
        return progress

    def _progress(self, request: Request) -> RequestProgress:
        if request.is_finished:
            status = "finished"
        else:
            status = request.status.value
        cached = request.num_cached_tokens
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            cached = self.kv_cache_manager.num_cached_tokens(request.all_token_ids)
        return RequestProgress(request.req_id, status, request.num_prompt_tokens, cached,
                               request.num_computed_prompt_tokens, request.num_output_tokens,
                               request.max_tokens)
