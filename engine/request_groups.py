"""Requests with n > 1: n child requests that share one prompt and stand as one request outside.

A group's children are `{req_id}#{i}`, seeded seed, seed + 1, ... when the request is seeded,
so that the choices differ. Child 0 enters the scheduler at once and the others once it has
produced its first token, so its prompt's full blocks are in the prefix cache and the others
compute only the last partial block: the prompt is prefilled once. Outside the engine the
group is the request: each child's output carries the group's id, the child's index and the
group's usage, and is `finished` only once every choice is; the router sees one prompt and n
decode budgets; an abort ends every choice with one last output.

The children are ordinary requests to the scheduler and to output processing; what makes them
a group (which child is whose, how many were admitted and finished) is held here, apart from
the step loop, which passes each step's outputs through `group_outputs` only while a group
exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec

from tandem.engine.outputs import RequestOutput, RequestProgress, Usage
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler


@dataclass
class RequestGroup:
    """A request with n > 1, as its n children."""

    req_id: str
    children: list[Request]
    completion_tokens: list[int]
    num_added: int = 1
    num_finished: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0


def child_requests(req_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """Each child's id and sampling params: n = 1, and seed + i when the request is seeded."""
    return [(f"{req_id}#{i}", replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**64))
            for i in range(params.n)]


class RequestGroups:
    """The engine's groups by request id, and each child's group and index."""

    def __init__(self, scheduler: Scheduler, changed: dict[str, Request]) -> None:
        self.scheduler = scheduler
        self.changed = changed  # requests whose progress changed since the last report (engine/reporting.py)
        self.groups: dict[str, RequestGroup] = {}
        self.child_of: dict[str, tuple[RequestGroup, int]] = {}  # child req_id -> (its group, its index)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.groups

    def add(self, req_id: str, children: list[Request]) -> None:
        """A new group of `children` (not yet in the scheduler); child 0 enters it now."""
        group = RequestGroup(req_id, children, [0] * len(children))
        self.groups[req_id] = group
        for i, child in enumerate(children):
            self.child_of[child.req_id] = (group, i)
        self.scheduler.add_request(children[0])
        self.changed[children[0].req_id] = children[0]

    def group_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs with each child's as its group's; the others as they are."""
        child_of = self.child_of
        if not child_of:
            return outputs
        return [self._group_output(out) if out.req_id in child_of else out for out in outputs]

    def _group_output(self, out: RequestOutput) -> RequestOutput:
        """A child's output as its group's: the group's id, the child's index, the group's usage,
        and `finished` only once every choice is. Child 0's first token admits the others."""
        group, index = self.child_of[out.req_id]
        group.completion_tokens[index] = out.usage.completion_tokens
        if index == 0:
            group.cached_tokens = out.usage.cached_tokens
            group.host_cached_tokens = out.usage.host_cached_tokens
            while group.num_added < len(group.children):
                child = group.children[group.num_added]
                group.num_added += 1
                if not child.is_finished:
                    self.scheduler.add_request(child)
                    self.changed[child.req_id] = child
        if out.finished:
            group.num_finished += 1
            self.changed[out.req_id] = group.children[index]  # its progress turns "finished" now
        done = group.num_finished == len(group.children)
        if done:
            self.groups.pop(group.req_id, None)
        usage = Usage(out.usage.prompt_tokens, sum(group.completion_tokens), group.cached_tokens,
                      group.host_cached_tokens)
        return msgspec.structs.replace(out, req_id=group.req_id, index=index, finished=done, usage=usage)

    def abort(self, req_id: str, tracked: dict[str, object]) -> RequestOutput | None:
        """Abort every choice of the group `req_id` and forget their entries in `tracked`; the
        one last output, finished, reports the request's usage so far. None: no such group."""
        group = self.groups.pop(req_id, None)
        if group is None:
            return None
        for child in group.children:
            if self.scheduler.finish_request(child.req_id, RequestStatus.FINISHED_ABORTED) is None:
                if not child.is_finished:  # not in the scheduler yet
                    child.status = RequestStatus.FINISHED_ABORTED
            tracked.pop(child.req_id, None)
            self.changed[child.req_id] = child
        group.num_finished = len(group.children)
        first = group.children[0]
        return RequestOutput(
            group.req_id, [], "", True, "abort",
            Usage(first.num_prompt_tokens, sum(c.num_resolved_output_tokens for c in group.children),
                  max(first.num_cached_tokens, 0), first.num_host_cached_tokens),
            first.arrival_time, first.first_scheduled_time, first.first_token_time, first.finished_time)

    def progress(self, group: RequestGroup, progress_of: Callable[[Request], RequestProgress]) -> RequestProgress:
        """A group as the router sees it: one prompt and n decode budgets, from each child's
        `progress_of`. Once it finished, its children are forgotten."""
        children = [progress_of(c) for c in group.children]
        first = children[0]
        aborted = RequestStatus.FINISHED_ABORTED  # an aborted choice's last placeholder never resolves
        if all(p.status == "finished" or c.status is aborted for p, c in zip(children, group.children)):
            status = "finished"
            for child in group.children:
                self.child_of.pop(child.req_id, None)
        elif any(p.status == "running" for p in children):
            status = "running"
        else:
            status = first.status
        return RequestProgress(group.req_id, status, first.num_prompt_tokens, first.num_cached_tokens,
                               first.num_computed_prompt_tokens, sum(p.num_output_tokens for p in children),
                               sum(p.max_tokens for p in children))
