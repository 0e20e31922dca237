"""From a step's sampled ids to `RequestOutput`s, and every way a request ends on the host.

Each sampled token fills its request's placeholder, meets the token-level stops (EOS, stop
token ids) and the grammar, is detokenized, and its text is checked for stop strings; then the
request's output for the step is built. This is per-request Python on every step (hundreds of
requests at high concurrency, while the GPU runs the next step), so `process_outputs` reads
each value once and inlines the common path. A request aborted or stopped after its step was
launched drops the token that step sampled for it.

A request ends here in one of three ways besides its scheduler's (max_tokens): a stop (`stop`,
the outputs after the stop dropped), an abort (`abort`, one last output, finished), or a fault
of its own (`fail`: its grammar, its logits processing or sampling, its detokenizer or stop
handling raised). A failed request's blocks are freed, the fault is logged under its id, and
its last output, finished with reason `FINISH_REASON_ERROR`, is queued for the end of the
step (`take_failed_outputs`), so nothing of it follows; every other request goes on as if it
had not been there.

The per-request state this needs and the torch-free scheduler does not hold (the detokenizer,
the sampling row) is `tracked`, filled in at admission (engine/admission.py) and dropped when
the request's last output is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.outputs import RequestOutput, Usage
from tandem.engine.request import Request, RequestStatus
from tandem.engine.request_groups import RequestGroups
from tandem.engine.sampler import SamplingRow
from tandem.engine.scheduler import Scheduler

FINISH_REASON_ERROR = "error"  # the last output of a request that failed on its own (see above)

logger = logging.getLogger("tandem.engine")


@dataclass
class TrackedRequest:
    """Per-request engine-side state that the torch-free scheduler does not hold."""

    detokenizer: IncrementalDetokenizer
    sampling_row: SamplingRow


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, groups: RequestGroups, changed: dict[str, Request]) -> None:
        self.scheduler = scheduler
        self.groups = groups
        self.changed = changed  # requests whose progress changed since the last report (engine/reporting.py)
        self.tracked: dict[str, TrackedRequest] = {}
        self.failed_outputs: list[RequestOutput] = []  # requests that failed in this step (`fail`)
        self.fault_injector: Callable[[str, str | None], None] | None = None  # the engine's (engine/llm_engine.py)

    def process_outputs(self, pending: list[tuple[Request, int]], tokens: list[int]) -> list[RequestOutput]:
        """Fill in each sampled token, apply token-level stops, detokenize and check stop
        strings, build the outputs (module doc). A request whose processing raises fails alone
        (`fail`), without this token."""
        outputs = []
        append = outputs.append
        now = time.time()
        tracked_by_id = self.tracked
        aborted = RequestStatus.FINISHED_ABORTED
        inject = self.fault_injector
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
                    self.stop(request, index)
                req_id = request.req_id
                tracked = tracked_by_id[req_id]
                new_token_ids = [token]
                detokenizer = tracked.detokenizer
                if detokenizer.add_tokens(new_token_ids):
                    self.stop(request, index)  # also on the max_tokens token: the stop string wins
                status = request.status
                finished = status.is_finished and not request.num_pending_tokens
                text = detokenizer.take_new_text(finished)
            except Exception as exc:
                self.fail(request, exc, "output", num_kept=index)
                continue
            if finished:
                request.finished_time = now
                del tracked_by_id[req_id]
                # Reported "running" while this token was on the device (finished at launch):
                # report it again, now finished, or the router counts it as load for ever.
                self.changed[req_id] = request
            append(RequestOutput(req_id, new_token_ids, text, finished, status.finish_reason if finished else None,
                                 Usage(prompt_len, len(output_ids) - request.num_pending_tokens,
                                       max(request.num_cached_tokens, 0), request.num_host_cached_tokens),
                                 request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                 request.finished_time))
        return outputs

    def advance_grammars(self, pending: list[tuple[Request, int]], tokens: list[int]) -> None:
        """Each grammar row accepts its sampled token; a grammar that is complete (its EOS
        accepted, even under ignore_eos) or that refuses the token stops its request there. A
        grammar that raises fails its request alone."""
        inject = self.fault_injector
        for (request, index), token in zip(pending, tokens):
            if request.status is RequestStatus.FINISHED_ABORTED or index >= len(request.output_token_ids):
                continue
            grammar = self.tracked[request.req_id].sampling_row.grammar
            if grammar is None:
                continue
            try:
                if inject is not None:
                    inject("grammar_accept", request.req_id)
                if not grammar.accept_token(token) or grammar.is_terminated():
                    self.stop(request, index)
            except Exception as exc:
                self.fail(request, exc, "grammar_accept", num_kept=index)

    @staticmethod
    def attach_logprobs(outputs: list[RequestOutput], logprobs: dict[int, tuple],
                        pending: list[tuple[Request, int]]) -> None:
        """Each output's token's logprobs (a request samples at most one token a step)."""
        by_req_id = {pending[row][0].req_id: entry for row, entry in logprobs.items()}
        for out in outputs:
            entry = by_req_id.get(out.req_id)
            if entry is not None:
                out.logprobs = [entry]

    def stop(self, request: Request, index: int) -> None:
        """Finish a request at output `index` (a stop token or string) and drop what was
        sampled after it."""
        if request.is_finished:  # finished at a later launch by max_tokens: it stopped first
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED)
        request.truncate_outputs(index + 1)

    def abort(self, req_id: str) -> RequestOutput | None:
        """Abort a request in the scheduler; its last output, finished. None: no such request."""
        request = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        self.tracked.pop(req_id, None)
        self.changed[req_id] = request
        return RequestOutput(
            req_id, [], "", True, request.status.finish_reason,
            Usage(request.num_prompt_tokens, request.num_resolved_output_tokens, max(request.num_cached_tokens, 0),
                  request.num_host_cached_tokens),
            request.arrival_time, request.first_scheduled_time, request.first_token_time, request.finished_time)

    def fail(self, request: Request, exc: BaseException, point: str, num_kept: int | None = None) -> None:
        """End one request that faulted on its own at `point`: free its blocks, keep its first
        `num_kept` outputs (default: those known on the host) and queue its last output, finished
        with reason "error", for the end of this step. A request already gone is left alone."""
        req_id = request.req_id
        if self.tracked.pop(req_id, None) is None:
            return  # finished, aborted or failed already
        logger.error("request %s failed in the engine (%s); it ends with an error, the others go on",
                     req_id, point, exc_info=exc)
        if self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED) is None:
            request.status = RequestStatus.FINISHED_ABORTED  # finished at launch (max_tokens): drop its last token
            if request.finished_time is None:
                request.finished_time = time.time()
        request.truncate_outputs(request.num_resolved_output_tokens if num_kept is None else num_kept)
        request.num_pending_tokens = 0  # its tokens still on the device are dropped when they land
        self.changed[req_id] = request
        self.failed_outputs.append(RequestOutput(
            req_id, [], "", True, FINISH_REASON_ERROR,
            Usage(request.num_prompt_tokens, request.num_output_tokens, max(request.num_cached_tokens, 0),
                  request.num_host_cached_tokens),
            request.arrival_time, request.first_scheduled_time, request.first_token_time, request.finished_time))

    def take_failed_outputs(self) -> list[RequestOutput]:
        """The last outputs of the requests that failed since the last call, as their groups'."""
        outputs, self.failed_outputs = self.failed_outputs, []
        return self.groups.group_outputs(outputs)
