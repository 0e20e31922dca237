"""Turns the last-position logits of each request into its next token, batched on the device.

An all-greedy batch with nothing else to apply takes one argmax over the batch: the fast path,
no other per-step cost. On the CPU that argmax is numpy's: torch's CPU argmax is not vectorized
and took ~120 us over SmolLM2's 49,152 logits (numpy's: ~6 us), about 1% of a CPU decode step. Any other batch goes through one batched pipeline, in vLLM's order:

1. penalties, for rows that have any: repetition (vLLM's: a logit of a token seen in the
   prompt or the output is divided by the penalty if positive, multiplied if negative), then
   frequency (minus penalty x count in the output) and presence (minus penalty once the token
   is in the output), as OpenAI defines them;
2. `logit_bias` added, and tokens a row must not pick yet (its stop tokens under min_tokens)
   set to -inf;
3. each row's grammar mask, for rows with one (`SamplingRow.grammar`, see `_apply_grammar`);
4. temperature (greedy rows keep theirs at 1);
5. logprobs, for rows that asked: the log-softmax of these logits, so they describe the
   distribution the sampler draws from after temperature, penalties and bias and before top-k,
   top-p and min-p cut its tail;
6. top-k, top-p and min-p as per-row tensors (one sort of the batch when a row has top-p, one
   `topk` when only top-k), then one draw for all rows by inverse-CDF sampling (one uniform a
   row and a `searchsorted`, no host sync). Seeded rows draw their uniform from their own
   `torch.Generator`, so a seeded request samples the same tokens whatever shares its batch.

Greedy rows in a mixed batch take the argmax after steps 1-3.

Penalties need the tokens a request has produced, and with asynchronous scheduling the newest
of them is still on the device when the next step is launched (a placeholder on the host). So
the sampler keeps the counts on the device: a `[slots, vocab]` buffer of output-token counts
(and one of prompt-token flags for the repetition penalty), one slot per live row that has
penalties, updated from the sampled ids on the device right after each draw. The host never
has to know the newest token, and no step waits for one. A slot is taken the first time a row
is sampled and returned when the row is garbage-collected (the engine drops it when its
request ends), so rows without penalties cost nothing.

`sample` leaves everything on the device (the runner copies the ids and logprobs to the host
once per step, asynchronously); calling the sampler reads the ids back with one `.tolist()`.

One request's fault fails that request, not the batch (the engine ends it with an error output,
engine/output_processor.py). A grammar whose bitmask cannot be filled leaves its row unmasked and is
recorded; a batch whose pipeline raises is sampled again one row at a time, and the rows that
raise alone are recorded while the others keep their tokens (greedy rows the same ids, seeded
rows the same draws: a row's draw is kept for the retry). Recorded rows are in `failures`, as
(row, exception, point), until the next `sample`; their sampled id is a stand-in the engine
drops. A failure no row explains (every row fails alone, or none does, or a batch of one) is
raised as before. `fault_injector` is a test's hook (the engine's, engine/llm_engine.py),
called as `fault_injector(point, req_id)` at the points "logits" (each row, as its sampling
starts) and "grammar_bitmask" (each grammar row, as its mask is filled); None costs nothing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.engine.sampling_params import SamplingParams

INITIAL_HISTORY_SLOTS = 8


@dataclass(eq=False)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # stop tokens while under min_tokens
    prompt_token_ids: list[int] = field(default_factory=list)  # read only with a repetition penalty
    # A structured-output matcher (fill_bitmask(bitmask, row_index) / accept_token(token_id) /
    # is_terminated()), or None.
    grammar: Any | None = None
    history_slot: int | None = None  # this row's slot in the sampler's token counts
    req_id: str | None = None  # the request's id, for fault reports (and a test's fault injector)
    # (the sampler's attempt number, this row's uniform) of a seeded draw, so a step that is
    # sampled again row by row after a failure draws nothing twice from the row's generator.
    drawn: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        params = self.params
        self.greedy = params.is_greedy
        self.needs_history = params.needs_history
        # Anything beyond argmax: the fast path is for batches where every row is plain.
        self.plain_greedy = self.greedy and not (self.needs_history or params.logit_bias
                                                  or params.logprobs is not None)
        # logit_bias as two lists once, so a step only extends the batch's lists with them.
        self.bias_ids = list(params.logit_bias)
        self.bias_values = list(params.logit_bias.values())


@dataclass
class LogprobsTensors:
    """Logprobs of the rows that asked for them (`rows`, indexes into the batch), on the device."""

    rows: list[int]
    num_top: list[int]  # top logprobs each of those rows asked for
    sampled: torch.Tensor  # float32 [len(rows)]: the sampled token's logprob
    top_ids: torch.Tensor  # int64 [len(rows), max(num_top)]
    top_logprobs: torch.Tensor  # float32 [len(rows), max(num_top)]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [batch]
    logprobs: LogprobsTensors | None = None


class Sampler:
    def __init__(self, sampling_vocab_size: int | None = None) -> None:
        # Random-weight presets pair a large vocab with a small tokenizer: sample only ids
        # the tokenizer can turn back into text.
        self.sampling_vocab_size = sampling_vocab_size
        self._counts: torch.Tensor | None = None  # float32 [slots, vocab]: output-token counts
        self._in_prompt: torch.Tensor | None = None  # bool [slots, vocab]
        self._free_slots: list[int] = []
        self.fault_injector: Any = None  # a test's hook: fault_injector(point, req_id); None in service
        self.failures: list[tuple[SamplingRow, BaseException, str]] = []  # of the last `sample`
        self._attempt = 0  # one per `sample` call: a seeded row draws once per attempt

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        return self.sample(logits, rows).sampled_token_ids.tolist()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The next token of each row (and logprobs where asked), left on the logits' device.
        Rows that failed on their own are in `failures` afterwards (see the module's doc)."""
        if self.failures:
            self.failures = []
        self._attempt += 1
        try:
            return self._sample(logits, rows)
        except Exception as exc:
            return self._sample_apart(logits, rows, exc)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if self.fault_injector is not None:
            for row in rows:
                self.fault_injector("logits", row.req_id)
        if self.sampling_vocab_size is not None:
            logits = logits[:, : self.sampling_vocab_size]
        if all(row.plain_greedy and not row.banned_token_ids and row.grammar is None for row in rows):
            return SamplerOutput(_argmax(logits))
        return self._sample_processed(self.processed_logits(logits, rows), rows)

    def _sample_apart(self, logits: torch.Tensor, rows: list[SamplingRow], exc: Exception) -> SamplerOutput:
        """The batch sampled again one row at a time after `exc`: the rows that fail alone are
        recorded in `failures` (a stand-in id 0 in their place, no logprobs), the others keep
        what they sample. `exc` is raised again when no row explains it."""
        if len(rows) == 1:
            raise exc
        outs: list[SamplerOutput | None] = []
        failed = []
        for i, row in enumerate(rows):
            try:
                outs.append(self._sample(logits[i:i + 1], [row]))
            except Exception as row_exc:
                outs.append(None)
                failed.append((row, row_exc, "logits"))
        if not failed or len(failed) == len(rows):
            raise exc
        self.failures.extend(failed)
        stand_in = torch.zeros(1, dtype=torch.int64, device=logits.device)
        sampled = torch.cat([stand_in if out is None else out.sampled_token_ids for out in outs])
        return SamplerOutput(sampled, _concat_logprobs(outs))

    def processed_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 1-4: the float32 logits each row samples from, before top-k/top-p/min-p (a new
        tensor; the token counts are read, not updated)."""
        logits = logits.to(torch.float32, copy=True)
        history = [i for i, row in enumerate(rows) if row.needs_history]
        if history:
            self._apply_penalties(logits, rows, history)
        _apply_bias_and_bans(logits, rows)
        if any(row.grammar is not None for row in rows):
            self._apply_grammar(logits, rows)
        if not all(row.greedy for row in rows):
            temperature = [1.0 if row.greedy else row.params.temperature for row in rows]
            logits.div_(_tensor(temperature, torch.float32, logits.device).unsqueeze(1))
        return logits

    def _sample_processed(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        greedy = [row.greedy for row in rows]
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        sampled = _argmax(logits) if any(greedy) else None
        if not all(greedy):
            drawn = _draw(_filter(logits, rows), rows, self._attempt)
            sampled = drawn if sampled is None else torch.where(
                _tensor(greedy, torch.bool, logits.device), sampled, drawn)
        out = SamplerOutput(sampled)
        if logprobs is not None:
            out.logprobs = _gather_logprobs(logprobs, sampled, rows, logprob_rows)
        history = [i for i, row in enumerate(rows) if row.needs_history]
        if history:  # last: a step that fails before it counts nothing, and may be sampled again
            self._count(sampled, rows, history)
        return out

    def _apply_grammar(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Rows with a grammar may only pick the tokens it allows: each grammar writes its row of
        a token bitmask on the host, applied in place (engine/structured_output.py). A grammar
        that fails leaves its row unmasked and is recorded in `failures`."""
        from tandem.engine.structured_output import apply_grammars

        def on_error(i: int, exc: Exception) -> None:
            self.failures.append((rows[i], exc, "grammar_bitmask"))

        grammars = [row.grammar for row in rows]
        inject = self.fault_injector
        if inject is not None:
            grammars = [None if row.grammar is None else _InjectedGrammar(row.grammar, inject, row.req_id)
                        for row in rows]
        apply_grammars(logits, grammars, on_error=on_error)

    # -- penalties: device-side token history ---------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], history: list[int]) -> None:
        """Only the penalties some row uses are computed: each is a few passes over the rows'
        `[vocab]` logits (cheap on a GPU, not on one CPU core)."""
        slots = [self._slot(rows[i], logits) for i in history]
        device = logits.device
        index = _tensor(history, torch.int64, device)
        slot_index = _tensor(slots, torch.int64, device)
        counts = self._counts.index_select(0, slot_index)
        params = [rows[i].params for i in history]
        sub = logits.index_select(0, index)
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = _tensor([p.repetition_penalty for p in params], torch.float32, device).unsqueeze(1)
            repeated = (counts > 0) | self._in_prompt.index_select(0, slot_index)
            sub = torch.where(repeated, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        if any(p.frequency_penalty for p in params):
            frequency = _tensor([p.frequency_penalty for p in params], torch.float32, device).unsqueeze(1)
            sub = sub.sub_(frequency * counts)
        if any(p.presence_penalty for p in params):
            presence = _tensor([p.presence_penalty for p in params], torch.float32, device).unsqueeze(1)
            sub = sub.sub_(presence * (counts > 0))
        logits.index_copy_(0, index, sub)

    def _count(self, sampled: torch.Tensor, rows: list[SamplingRow], history: list[int]) -> None:
        """Add each history row's sampled id to its counts, on the device (no host sync)."""
        device = sampled.device
        slot_index = _tensor([rows[i].history_slot for i in history], torch.int64, device)
        token_ids = sampled.index_select(0, _tensor(history, torch.int64, device))
        ones = torch.ones(len(history), dtype=self._counts.dtype, device=device)
        self._counts.index_put_((slot_index, token_ids), ones, accumulate=True)

    def _slot(self, row: SamplingRow, logits: torch.Tensor) -> int:
        if row.history_slot is not None:
            return row.history_slot
        vocab = logits.shape[-1]
        if self._counts is None or self._counts.shape[1] != vocab or self._counts.device != logits.device:
            self._counts = torch.zeros(INITIAL_HISTORY_SLOTS, vocab, device=logits.device)
            self._in_prompt = torch.zeros(INITIAL_HISTORY_SLOTS, vocab, dtype=torch.bool, device=logits.device)
            self._free_slots = list(range(INITIAL_HISTORY_SLOTS - 1, -1, -1))
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self._counts[slot].zero_()
        self._in_prompt[slot].zero_()
        prompt = [t for t in row.prompt_token_ids if t < vocab]
        if prompt and row.params.repetition_penalty != 1.0:
            self._in_prompt[slot, _tensor(prompt, torch.int64, logits.device)] = True
        row.history_slot = slot
        weakref.finalize(row, self._free_slots.append, slot)
        return slot

    def _grow(self) -> None:
        num_slots, vocab = self._counts.shape
        counts = torch.zeros(2 * num_slots, vocab, device=self._counts.device)
        in_prompt = torch.zeros(2 * num_slots, vocab, dtype=torch.bool, device=self._counts.device)
        counts[:num_slots] = self._counts
        in_prompt[:num_slots] = self._in_prompt
        self._counts, self._in_prompt = counts, in_prompt
        self._free_slots.extend(range(2 * num_slots - 1, num_slots - 1, -1))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first highest logit (int64 [B]); float32 CPU logits through numpy's vectorized
    argmax, which picks the same index (the first maximum, a NaN before any number)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-row tensor on the device, staged in pinned memory on cuda so the copy never
    waits for the device's queue (see engine/host_tensors.py)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _apply_bias_and_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit_bias and banned tokens as two scatters over the whole batch. A bias on an id past
    the sampling vocabulary (a random preset's) is clamped and zeroed on the device, so nothing
    here reads a device value back."""
    bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
    for i, row in enumerate(rows):
        if row.bias_ids:
            bias_rows += [i] * len(row.bias_ids)
            bias_ids += row.bias_ids
            bias_values += row.bias_values
    device, vocab = logits.device, logits.shape[-1]
    for i, row in enumerate(rows):
        for token_id in row.banned_token_ids:  # a few stop ids, only while under min_tokens
            if token_id < vocab:
                ban_rows.append(i)
                ban_ids.append(token_id)
    if bias_rows:
        ids = _tensor(bias_ids, torch.int64, device)
        values = _tensor(bias_values, torch.float32, device).masked_fill_(ids >= vocab, 0.0)
        logits.index_put_((_tensor(bias_rows, torch.int64, device), ids.clamp_(max=vocab - 1)), values,
                          accumulate=True)
    if ban_rows:
        logits[_tensor(ban_rows, torch.int64, device), _tensor(ban_ids, torch.int64, device)] = float("-inf")


class _InjectedGrammar:
    """A grammar whose bitmask fill first calls a test's fault injector (point "grammar_bitmask")."""

    def __init__(self, grammar: Any, inject: Any, req_id: str | None) -> None:
        self.grammar, self.inject, self.req_id = grammar, inject, req_id

    def fill_bitmask(self, bitmask: torch.Tensor, row_index: int) -> None:
        self.inject("grammar_bitmask", self.req_id)
        self.grammar.fill_bitmask(bitmask, row_index)


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Probabilities after each row's top-k, top-p and min-p (rows without them untouched)."""
    device, vocab = logits.device, logits.shape[-1]
    top_k = [row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows]
    top_p = [row.params.top_p for row in rows]
    min_p = [row.params.min_p for row in rows]
    if any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, _tensor(top_k, torch.int64, device), _tensor(top_p, torch.float32, device))
    elif any(k < vocab for k in top_k):
        logits = _top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if any(min_p):
        threshold = probs.amax(dim=-1, keepdim=True) * _tensor(min_p, torch.float32, device).unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Top-k alone: the k-th largest logit of each row from one `topk` of the largest k, no sort
    of the whole vocabulary (which costs ~6 ms a row on one CPU core at 49k tokens)."""
    values = logits.topk(max(top_k), dim=-1).values
    kth = values.gather(1, _tensor([k - 1 for k in top_k], torch.int64, logits.device).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's batched top-k/top-p: one ascending sort, the k-th largest as a per-row threshold,
    and the smallest head of the sorted distribution whose mass reaches p (at least one token)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)
    kth = sorted_logits.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return sorted_logits.scatter(1, sorted_ids, sorted_logits)


def _draw(probs: torch.Tensor, rows: list[SamplingRow], attempt: int = 0) -> torch.Tensor:
    """One token per row by inverse-CDF sampling: a uniform u in (0, 1] per row, and the first
    token whose cumulative probability reaches u (a zero-probability token never does). One
    random number a row, not one per vocabulary entry; seeded rows draw theirs from their own
    generator, so a seeded request samples the same tokens whatever shares its batch (and draws
    once per `attempt`: a step sampled again row by row reuses the draw)."""
    u = torch.rand(probs.shape[0], 1, device=probs.device)
    for i, row in enumerate(rows):
        if row.generator is not None and not row.greedy:
            drawn = row.drawn
            if drawn is None or drawn[0] != attempt:
                drawn = row.drawn = (attempt, torch.rand(1, device=probs.device, generator=row.generator))
            u[i] = drawn[1]
    cdf = probs.cumsum_(dim=-1)
    target = (1.0 - u) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, rows: list[SamplingRow],
                     logprob_rows: list[int]) -> LogprobsTensors:
    index = _tensor(logprob_rows, torch.int64, logprobs.device)
    sampled_lp = logprobs.gather(1, sampled.index_select(0, index).unsqueeze(1)).squeeze(1)
    num_top = [rows[i].params.logprobs for i in logprob_rows]
    top = logprobs.topk(max(num_top), dim=-1) if max(num_top) else None
    empty = logprobs.new_empty(len(logprob_rows), 0)
    return LogprobsTensors(logprob_rows, num_top, sampled_lp,
                           top.indices if top is not None else empty.long(),
                           top.values if top is not None else empty)


def _concat_logprobs(outs: list[SamplerOutput | None]) -> LogprobsTensors | None:
    """The logprobs of single-row outputs as one batch's (rows renumbered, top lists padded)."""
    parts = [(i, out.logprobs) for i, out in enumerate(outs) if out is not None and out.logprobs is not None]
    if not parts:
        return None
    width = max(lp.top_ids.shape[1] for _, lp in parts)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return LogprobsTensors([i for i, _ in parts], [lp.num_top[0] for _, lp in parts],
                           torch.cat([lp.sampled for _, lp in parts]),
                           torch.cat([pad(lp.top_ids, 0) for _, lp in parts]),
                           torch.cat([pad(lp.top_logprobs, 0.0) for _, lp in parts]))
