"""Every message that crosses a process on the serving path, typed, and their one codec.

vLLM v1's shape: the front end hands the engine core a typed `EngineCoreRequest` and gets back
typed outputs batched per engine step, never one message per request. Two hops carry them:

- a caller's channel to a backend's engine core (actors/channel.py is the caller's end,
  actors/fanout.py the core's): `ChannelOpen`, then `ChannelAdds` of `EngineCoreRequest`s one
  way, a `ChannelBatch` of admissions and the engine's own `RequestOutput`s (a msgspec struct
  too, so they go as the engine made them) per step the other, on the same-node wire
  (actors/wire.py) or, from another node, on Ray as encoded bytes;
- the core pipe between a backend actor and its engine core (actors/engine_core.py), the
  control plane: `EngineCoreCall`s (an abort among them) and `EngineCoreStop` to the core, one
  `EngineCoreOutputs` per step back (progress, timing, cache changes, replies; no tokens).

The router's batched `place` calls on the wire are `WireCalls`/`WireAnswers`.

Why msgspec structs with named fields: a reader of any hop sees `output.finished`, not
`packed[3]`, and every field has a type the decoder checks. Why msgpack: a step's message of
256 outputs encodes and decodes faster than the pickled tuples it replaces
(docs/benchmarks/message-codec.md). What msgpack cannot carry natively (an exception, a
tokenizer, a control call's result) goes as a pickle inside a msgpack extension, as vLLM does;
only the control plane and errors take that path. Decoding may unpickle, so a wire decodes a
frame only after its connection presented the server's token.

`BackendInfo` and `Decision` go between actors as Ray call arguments and stay dataclasses.

Kept free of torch and ray so the HTTP ingress and driver scripts can import it cheaply.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from tandem.engine.outputs import RequestOutput, RequestProgress
from tandem.engine.sampling_params import SamplingParams

_PICKLED = 1  # msgpack extension code: a pickled Python object


class _Message(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of every message: positional on the wire (no field names in each frame), tagged
    by class so one decoder reads any of them."""


# -- a request, on its caller's channel -----------------------------------------------------
class EngineCoreRequest(_Message, tag="req"):
    """One request to add, built once by whoever tokenized it and sent on its caller's channel."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None = None


# -- front -> engine core (the core pipe) ---------------------------------------------------
class EngineCoreCall(_Message, tag="call"):
    """Run the core's `call_<name>(*args)` between two steps (control plane)."""

    call_id: int
    name: str
    args: list[Any]


class EngineCoreStop(_Message, tag="stop"):
    pass


# -- engine core -> front ------------------------------------------------------------------
class EngineCoreReady(_Message, tag="ready"):
    """The core's first message: its engine loaded."""

    device: str
    device_kind: str
    dtype: str
    max_active: int
    block_size: int
    num_kv_tokens: int
    cpu_kernels: str
    model_name: str
    max_model_len: int
    max_priority_wait_s: float  # the scheduler's starvation bound for less urgent requests
    tokenizer: Any  # the HF tokenizer (pickled)
    load_s: float
    pid: int
    wire_address: tuple[str, bytes]  # where the core serves its channels (actors/wire.py): path, token


class EngineCoreFailed(_Message, tag="failed"):
    """The engine could not load, or a step failed (the core has failed the step's channel requests)."""

    traceback: str


class CallReply(_Message, tag="reply"):
    """A control call's result (`ok`) or exception; pickled, since a control call may return
    any Python object."""

    call_id: int
    ok: bool
    value: Any

    @classmethod
    def of(cls, call_id: int, ok: bool, value: Any) -> CallReply:
        return cls(call_id, ok, msgspec.msgpack.Ext(_PICKLED, pickle.dumps(value, protocol=5)))


class StepTiming(_Message, tag="timing"):
    """One engine step's size and time: the router's online calibration."""

    prefill_tokens: int
    decode_tokens: int
    batch_size: int
    elapsed_s: float


class StatsTotals(_Message, tag="stats"):
    """The engine stats the front exports as gauges (the first four and `kv_host_usage`) and
    counters (the rest, totals since the engine started; see actors/metrics.py)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    # the host KV tier (zeros without one): hits and copies since start, and its occupancy
    prefix_cache_host_hits: int = 0
    kv_host_offloaded_bytes: int = 0
    kv_host_reloaded_bytes: int = 0
    kv_host_usage: float = 0.0

    @classmethod
    def of(cls, st: Any) -> StatsTotals:
        return cls(st.num_running, st.num_waiting, st.kv_cache_usage, st.num_free_blocks, st.prefix_cache_queries,
                   st.prefix_cache_hits, st.num_prompt_tokens_total, st.num_generation_tokens_total,
                   st.num_preemptions, st.prefix_cache_host_hits, st.kv_host_offloaded_blocks * st.kv_block_bytes,
                   st.kv_host_reloaded_blocks * st.kv_block_bytes,
                   st.num_host_used_blocks / st.num_host_total_blocks if st.num_host_total_blocks else 0.0)


class FinishedRequest(_Message, tag="finished"):
    """A request's end and its timings (`time.time()` stamps): the front's latency metrics."""

    finish_reason: str | None
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @classmethod
    def of(cls, out: RequestOutput) -> FinishedRequest:
        return cls(out.finish_reason, out.arrival_time, out.first_scheduled_time, out.first_token_time,
                   out.finished_time)


class EngineCoreOutputs(_Message, tag="outs"):
    """What one engine step (or one batch of commands while idle) tells the front, the control
    plane: the answers to the control calls applied since the last message, the requests that
    finished, the router's progress (each changed request's absolute counts), the step's
    timing, the prefix cache's block hashes whose KV tier changed (1 on the device, 2 only in the
    host tier, 0 nowhere: engine/kv_cache/manager.py), and the stats. The requests' tokens and
    text go to their callers' channels, not here."""

    replies: list[CallReply] = []
    finished: list[FinishedRequest] = []
    progress: list[RequestProgress] = []
    step: StepTiming | None = None
    cache_changes: dict[int, int] = {}
    stats: StatsTotals | None = None


# -- a caller's channel to a backend (wire frames, or bytes over Ray) ------------------------
class Admitted(_Message, tag="admitted"):
    """A request's first item on its channel: the engine accepted it.

    Callers wait for it before answering HTTP, so a request the engine rejects still gets a
    proper 4xx status instead of an error inside a 200 stream. It carries the request's first
    outputs when the engine's next step or the one after brings them (all of a one-token
    request), so the first token reaches the caller with the answer instead of a channel
    message later; a request still queued then is admitted without them.

    `received_time` (the engine core read the add off its channel) and `queued_time` (its engine
    queued the request) are `time.time()` stamps that split the add's trip into its hops
    (cluster/dispatch.py `admission_stages`); None where a path does not stamp them.
    """

    req_id: str
    backend_id: str
    num_prompt_tokens: int
    outputs: list[RequestOutput] = []
    received_time: float | None = None
    queued_time: float | None = None


class Refusal(_Message, tag="refused"):
    """A request of the channel failed: refused at its add, or its engine failed under it."""

    req_id: str
    error: Any  # the exception (pickled)


class ChannelOpen(_Message, tag="open"):
    """A wire connection's first frame: the channel it carries."""

    channel_id: str


class ChannelAdds(_Message, tag="adds"):
    requests: list[EngineCoreRequest]


class ChannelBatch(_Message, tag="batch"):
    """One hand-over from a backend to a caller: admissions, refusals and outputs, a
    channel's admissions before its outputs."""

    items: list[Union[RequestOutput, Admitted, Refusal]]


# -- the router's `place_many` (a batch of these per call, on the wire or over Ray) ----------
class PlaceRequest(_Message, tag="place"):
    """One request to place: its lengths and prompt, which attempt this is (> 1: its previous
    backend failed before it started), its priority class (SamplingParams.priority, lower is
    more urgent) and its TTFT deadline in seconds (None: none)."""

    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    attempt: int = 1
    priority: int = 0
    ttft_deadline_s: float | None = None


class Placement(_Message, tag="placed"):
    """The router's answer to a `PlaceRequest`: the backend, the chosen backend's score
    (`estimated_s`) and its projected time to first token (routing/deadline.py). Callers keep
    the backends' handles from `list_backends`, so the answer carries none."""

    backend_id: str
    instance_id: str
    estimated_s: float
    projected_ttft_s: float


# -- batched calls on the wire (the router's `place_many`) -----------------------------------
class WireCall(_Message, tag="wcall"):
    """A call's arguments. A struct among them (a `PlaceRequest`) travels as its array and is
    read back with `msgspec.convert`, as is a struct in a `WireAnswer`."""

    call_id: int
    args: list[Any]


class WireCalls(_Message, tag="wcalls"):
    calls: list[WireCall]


class WireAnswer(_Message, tag="wanswer"):
    call_id: int
    value: Any  # the result, or the exception to raise (pickled)


class WireAnswers(_Message, tag="wanswers"):
    answers: list[WireAnswer]


Message = Union[EngineCoreRequest, EngineCoreCall, EngineCoreStop, EngineCoreReady,
                EngineCoreFailed, EngineCoreOutputs, ChannelOpen, ChannelAdds, ChannelBatch, WireCalls,
                WireAnswers]


def _enc_hook(obj: Any) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(_PICKLED, pickle.dumps(obj, protocol=5))


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _PICKLED:
        raise ValueError(f"unknown msgpack extension {code}")
    return pickle.loads(data)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, ext_hook=_ext_hook)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


@dataclass
class BackendInfo:
    """What a backend tells the router when it (re)joins, and the driver when asked."""

    backend_id: str
    instance_id: str  # new on every (re)start, so a stale failure report cannot drop a new incarnation
    device: str
    device_kind: str
    requested_device: str
    dtype: str
    threads: int
    max_active: int
    block_size: int
    model_name: str
    max_model_len: int
    node_id: str = ""
    rates: dict[str, Any] | None = None  # routing's RateProfile fields; None: keep the router's
    reconstructed: bool = False
    num_kv_tokens: int = 0  # the KV cache's size in tokens
    cpu_kernels: str = ""  # the kernels a cpu backend runs ("" on accelerators)
    # The accelerator across the cluster (node and the GPU ids Ray assigned): backends naming the
    # same one share its compute. `device` cannot tell (each actor sees its GPU as cuda:0). "": cpu.
    shared_device: str = ""
    max_priority_wait_s: float | None = None  # the scheduler's starvation bound; None: unknown
    emulated_kind: str = ""  # a sim backend: the kind of device it emulates (cpu, cuda, mps); "": real

    @property
    def routing_kind(self) -> str:
        """The kind the router treats it as: a sim backend is the device it emulates."""
        return self.emulated_kind or self.device_kind


@dataclass
class Decision:
    """The router's answer to `route`: where to send the request and the full record."""

    req_id: str
    backend_id: str
    instance_id: str
    record: dict[str, Any] = field(default_factory=dict)  # routing.DecisionRecord.to_dict()
    estimated_s: float = 0.0
    handle: Any = None  # the chosen backend's actor handle
    projected_ttft_s: float = 0.0  # the chosen backend's projected TTFT (routing/deadline.py)
