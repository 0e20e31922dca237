"""BackendActor as a plain object (no Ray): its engine core, channels, aborts and cache queries.

The actor class is ordinary Python until the launcher wraps it with `ray.remote`, so its
concurrency logic is tested here in-process with the tiny random model, in seconds.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from tandem.actors.backend import BackendActor
from tandem.actors.fanout import MAX_UNSENT_BYTES, ChannelState, Fanout
from tandem.actors.wire import FrameSplitter
from tandem.actors.messages import (Admitted, ChannelAdds, ChannelOpen, EngineCoreRequest, Refusal,
                                    decode, encode)
from tandem.engine.outputs import RequestOutput, Usage
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams

ENGINE = dict(model="tiny-llama-random", device="cpu", max_active=4, block_size=16)


class FakeRouter:
    """Collects `report.remote(...)` calls made from the engine thread."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, str, list]] = []
        self.cache_changes: dict[int, bool] = {}
        self.report = self

    def options(self, **options):
        assert options == {"enable_task_events": False}  # reports leave no task events in Ray's GCS
        return self

    def remote(self, backend_id, instance_id, progress, steps=(), cache_changes=None):
        self.reports.append((backend_id, instance_id, progress))
        self.cache_changes.update(cache_changes or {})


@pytest.fixture(scope="module")
def backend():
    actor = BackendActor("cpu0", ENGINE, threads=1)
    yield actor
    run(actor.shutdown())


def run(coro, timeout_s: float = 60.0):
    """asyncio.run with a deadline, so a stuck engine thread fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _decoded(frames: FrameSplitter, chunk: bytes) -> list:
    """The items of every `ChannelBatch` frame a subscription's chunk completes."""
    return [item for payload in frames.feed(chunk) for item in decode(payload).items]


async def collect(actor, req_id, ids, params):
    """One request on a channel of its own: its outputs as `RequestOutput`s (the first ones those
    its admission brought); the refusal's exception raised."""
    subscription = actor.subscribe(f"ch-{req_id}")
    reading = asyncio.ensure_future(subscription.__anext__())
    await actor.add_many(f"ch-{req_id}", _adds([(req_id, ids, params)]))
    items, frames = [], FrameSplitter()
    try:
        while not items or not _finished(items[-1]):
            batch = _decoded(frames, await reading)
            items += batch
            if batch and isinstance(batch[-1], Refusal):
                raise batch[-1].error
            if not items or not _finished(items[-1]):
                reading = asyncio.ensure_future(subscription.__anext__())
    finally:
        await subscription.aclose()
    assert isinstance(items[0], Admitted) and items[0].num_prompt_tokens == len(ids)
    return items[0].outputs + items[1:]


def test_a_channel_streams_deltas_and_finishes(backend):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = run(collect(backend, "a", list(range(10, 30)), params))
    # Steps' tokens may share a message (a channel's pacing), but none is lost and no message
    # is empty.
    assert sum(len(o.new_token_ids) for o in outs) == 6 and all(o.new_token_ids for o in outs)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])


def test_concurrent_streams_interleave_and_match_solo_greedy(backend):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = {f"c{i}": list(range(40 + 7 * i, 60 + 7 * i)) for i in range(3)}

    async def run_all():
        return await asyncio.gather(*(collect(backend, r, ids, params) for r, ids in prompts.items()))

    together = run(run_all())
    solo = [run(collect(backend, f"solo-{r}", ids, params)) for r, ids in prompts.items()]
    for batched, alone in zip(together, solo):
        assert [t for o in batched for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]


def test_a_rejected_request_is_refused_instead_of_admitted(backend):
    params = SamplingParams(max_tokens=5000, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="context length"):
        run(collect(backend, "too-long", [1, 2, 3], params))


def test_closing_a_channel_aborts_its_requests_and_frees_blocks(backend):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def read_two_then_close():
        subscription = backend.subscribe("ch-abandoned")
        reading = asyncio.ensure_future(subscription.__anext__())
        await backend.add_many("ch-abandoned", _adds([("abandoned", list(range(5, 60)), params)]))
        assert isinstance(_decoded(FrameSplitter(), await reading)[0], Admitted)
        await subscription.__anext__()
        await subscription.aclose()  # what Ray does when the caller closes the channel
        for _ in range(100):
            stats = await backend.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = run(read_two_then_close())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0


def test_abort_ends_the_request_with_reason_abort(backend):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def abort_midway():
        reading = asyncio.ensure_future(collect(backend, "to-abort", list(range(70, 90)), params))
        while not await backend.num_channel_requests():  # the core has it on its channel
            await asyncio.sleep(0.01)
        assert await backend.abort("to-abort")
        return await reading

    outs = run(abort_midway())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"


def test_num_cached_tokens_sees_a_finished_prompt(backend):
    ids = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    assert run(backend.num_cached_tokens(ids)) == 0
    run(collect(backend, "warm", ids, SamplingParams(max_tokens=2, temperature=0.0)))
    assert run(backend.num_cached_tokens(ids)) == 48


def test_progress_reaches_the_router_in_batches():
    router = FakeRouter()
    actor = BackendActor("cpu9", ENGINE, threads=1, router=None)
    actor.reporter.router = router  # set after start: outside Ray there is no registration to do
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        run(collect(actor, "p", list(range(10, 40)), params))

        def events():
            return [p for _, _, batch in router.reports for p in batch if p.req_id == "p"]

        for _ in range(500):  # the idle loop flushes what is left; allow a loaded machine 10 s
            if events() and events()[-1].status == "finished":
                break
            asyncio.run(asyncio.sleep(0.02))
    finally:
        run(actor.shutdown())
    events = events()
    assert events[-1].status == "finished" and events[-1].num_output_tokens == 10
    assert {b for b, _, _ in router.reports} == {"cpu9"}
    assert len(router.reports) < 11  # batched: fewer reports than tokens


def test_reported_cache_changes_mirror_the_engine_prefix_cache():
    """The router answers prefix hits from the hashes backends report; they must agree with
    the engine's own answer, without asking it."""
    from tandem.actors.cache_mirror import CacheMirror, prompt_block_hashes

    router = FakeRouter()
    actor = BackendActor("cpu8", ENGINE, threads=1, router=None)
    actor.reporter.router = router
    try:
        shared = list(range(200, 240))  # 40 tokens: 2 full blocks of 16
        run(collect(actor, "m0", shared + [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0)))
        run(collect(actor, "m1", [9] * 20, SamplingParams(max_tokens=2, temperature=0.0)))
        probes = (shared + [7] * 30, shared[:20] + [5], [9] * 20 + [4], [1, 2, 3])
        engine_answers = [run(actor.num_cached_tokens(probe)) for probe in probes]

        def mirror_answers():
            mirror = CacheMirror(16)
            mirror.apply(router.cache_changes)
            return [mirror.num_cached_tokens(prompt_block_hashes(p, [16])[16], len(p)) for p in probes]

        for _ in range(500):  # reports are batched every ~20 ms; allow a loaded machine 10 s
            if mirror_answers() == engine_answers:
                break
            run(asyncio.sleep(0.02))
        assert mirror_answers() == engine_answers == [32, 16, 16, 0]
    finally:
        run(actor.shutdown())


def _adds(requests) -> bytes:
    """`add_many`'s argument: the encoded `ChannelAdds` of (req_id, ids, params) triples."""
    return encode(ChannelAdds([EngineCoreRequest(req_id, ids, params) for req_id, ids, params in requests]))


def _finished(item) -> bool:
    if isinstance(item, Admitted):
        return bool(item.outputs) and item.outputs[-1].finished
    return isinstance(item, RequestOutput) and item.finished


async def _channel_run(actor, channel_id, requests):
    """Add `requests` ((req_id, ids, params)) on one channel; returns each one's Admitted (which
    the channel brings first) and the `RequestOutput`s the channel brought for it after."""
    batches: list = []
    frames = FrameSplitter()

    async def read() -> None:
        async for chunk in actor.subscribe(channel_id):
            batches.extend(_decoded(frames, chunk))

    reader = asyncio.get_running_loop().create_task(read())
    assert await actor.add_many(channel_id, _adds(requests)) is None
    pending = {req_id for req_id, _, _ in requests}
    while pending:
        await asyncio.sleep(0.01)
        pending -= {item.req_id for item in batches if _finished(item)}
    reader.cancel()
    admitted: dict = {}
    for item in batches:
        if isinstance(item, Admitted):
            assert item.req_id not in admitted, item  # one admission each
            admitted[item.req_id] = item
    outputs = [item for item in batches if isinstance(item, RequestOutput)]
    for req_id in admitted:  # a request's admission comes before its outputs
        assert isinstance(next(i for i in batches if i.req_id == req_id), Admitted), batches
    return ([admitted[r] for r, _, _ in requests],
            {r: [o for o in outputs if o.req_id == r] for r, _, _ in requests})


def test_a_channel_add_brings_the_first_token_and_the_channel_the_rest(backend):
    """The admission carries the outputs of the step that admitted the request (its first
    token, here all of a one-token request); the channel brings the rest, none twice."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = list(range(40, 60))
    solo = [t for o in run(collect(backend, "solo", ids, greedy)) for t in o.new_token_ids]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    admitted, by_req = run(_channel_run(backend, "ch-test", [("c6", ids, greedy), ("c1", ids, one)]))
    six, single = admitted
    assert six.outputs and not six.outputs[-1].finished  # the first token came with the admission
    assert six.received_time <= six.queued_time  # the add's hops, stamped
    assert [t for o in six.outputs + by_req["c6"] for t in o.new_token_ids] == solo
    assert single.outputs[-1].finished and single.outputs[-1].new_token_ids == solo[:1] and by_req["c1"] == []


def test_a_rejected_channel_add_is_answered_on_the_channel(backend):
    async def scenario():
        batches: list = []
        frames = FrameSplitter()

        async def read() -> None:
            async for chunk in backend.subscribe("ch-bad"):
                batches.extend(_decoded(frames, chunk))

        reader = asyncio.get_running_loop().create_task(read())
        too_long = SamplingParams(max_tokens=10**6, temperature=0.0)
        eight = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        await backend.add_many("ch-bad", _adds([("bad", [5, 6], too_long), ("ok", [5, 6], eight)]))
        await backend.add_many("ch-bad", _adds([("ok", [5, 6], eight)]))  # a duplicate id, while "ok" runs
        while not any(i.req_id == "ok" and _finished(i) for i in batches):
            await asyncio.sleep(0.01)
        reader.cancel()
        return batches

    batches = run(scenario())
    answers = [i for i in batches if not isinstance(i, RequestOutput)]
    kinds = sorted((i.req_id, type(i.error if isinstance(i, Refusal) else i).__name__) for i in answers)
    assert kinds == [("bad", "InvalidRequestError"), ("ok", "Admitted"), ("ok", "InvalidRequestError")]
    admitted = next(a for a in answers if isinstance(a, Admitted))
    tokens = [t for o in admitted.outputs for t in o.new_token_ids] + [
        t for i in batches if isinstance(i, RequestOutput) for t in i.new_token_ids]
    assert len(tokens) == 8  # the running request lost nothing to the refused duplicate


def test_the_wire_admits_streams_and_aborts_on_hang_up(backend):
    """The same-node wire carries what add_many + subscribe carry (admission first, then the
    outputs, the tokens of a solo run), and a caller hanging up aborts its unfinished requests
    in the engine core."""
    from tandem.actors import wire

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    endless = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)  # within the 1,024 context
    ids = list(range(70, 90))
    solo = [t for o in run(collect(backend, "wire-solo", ids, greedy)) for t in o.new_token_ids]

    async def scenario():
        _, address = await backend.wire_address()
        reader, writer = await wire.connect(address)
        writer.write(wire.frame(ChannelOpen("ch-wire")))
        writer.write(wire.frame(ChannelAdds([EngineCoreRequest("w6", ids, greedy),
                                             EngineCoreRequest("w-long", ids, endless)])))
        items: list = []
        while not any(i.req_id == "w6" and _finished(i) for i in items):
            items.extend((await wire.read_frame(reader)).items)
        assert any(isinstance(i, Admitted) and i.req_id == "w-long" for i in items)
        writer.close()  # hang up with w-long still running
        while await backend.num_channel_requests():  # the hang-up took w-long out of the channel...
            await asyncio.sleep(0.01)
        while (await backend.stats()).num_running:  # ...and aborted it in the engine
            await asyncio.sleep(0.01)
        return items

    items = run(scenario())
    import ray

    assert not ray.is_initialized()  # asking for the node id outside Ray must not start Ray
    mine = [i for i in items if i.req_id == "w6"]
    admitted = mine[0]  # the admission comes first
    assert isinstance(admitted, Admitted) and admitted.num_prompt_tokens == len(ids)
    tokens = [t for o in admitted.outputs for t in o.new_token_ids] + [
        t for i in mine[1:] for t in i.new_token_ids]
    assert tokens == solo


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_wire_address_is_the_engine_core_s_own_socket(backend):
    """A caller's channel goes to the engine core process, not through the actor: the socket
    `wire_address` names is listened on by the core's pid, and no other process."""
    _, (path, _) = run(backend.wire_address())
    core_pid = run(backend.core_pid())
    assert core_pid != os.getpid()
    assert listening_pids(path) == [core_pid]


def listening_pids(path: str) -> list[int]:
    """The processes holding the listening Unix socket bound to `path` (abstract: leading NUL)."""
    name = "@" + path[1:] if path.startswith("\0") else path
    with open("/proc/net/unix") as table:
        inodes = {line.split()[6] for line in table.read().splitlines()[1:]
                  if len(line.split()) > 7 and line.split()[7] == name}
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or not ours to read
            continue
        if any(link == f"socket:[{inode}]" for link in links for inode in inodes):
            pids.append(int(pid))
    return pids


def test_an_admission_waits_for_first_outputs_that_come_a_step_later():
    """With asynchronous scheduling a step's tokens come with the next step: the admission is
    held for them one step, no longer, and a rejection is not held at all."""
    commands: list = []
    fanout = Fanout("b", to_core=commands.append)  # the bookkeeping only: no engine core, no socket
    channel = ChannelState("ch")
    params = SamplingParams(max_tokens=4)
    r, s = EngineCoreRequest("r", [1] * 20, params), EngineCoreRequest("s", [1] * 5, params)
    fanout.add(channel, [r, s])
    assert commands == [[r, s]] and channel.req_ids == {"r", "s"}
    fanout._admitting["r"].received = fanout._admitting["s"].received = 1.0
    error = InvalidRequestError("too long")
    admissions: dict = {}
    assert fanout._admissions([("r", 20, 2.0)], [("s", error)], [], admissions) == []
    assert admissions[id(channel)][1] == [Refusal("s", error)]
    assert "s" not in fanout.channel_of  # a rejected request leaves its channel
    first = RequestOutput("r", [5], "x", False, None, Usage(20, 1, 0))
    other = RequestOutput("q", [6], "y", False, None, Usage(3, 1, 0))
    admissions = {}
    assert fanout._admissions([], [], [first, other], admissions) == [other]
    assert admissions[id(channel)][1] == [Admitted("r", "b", 20, [first], 1.0, 2.0)]
    admissions = {}
    assert fanout._admissions([], [], [first], admissions) == [first] and admissions == {}  # admitted already
    # A request with no output in the next step either (queued) is admitted without outputs.
    fanout.add(channel, [s])
    fanout._admitting["s"].received = 1.0
    assert fanout._admissions([("s", 5, 2.0)], [], [], admissions) == [] and admissions == {}
    assert fanout._admissions([], [], [other], admissions) == [other]
    assert admissions[id(channel)][1] == [Admitted("s", "b", 5, [], 1.0, 2.0)]
    assert not fanout._awaiting_first


def test_a_duplicate_id_is_refused_and_a_closed_channel_aborts_its_requests():
    from tandem.actors.fanout import Abort

    commands: list = []
    fanout = Fanout("b", to_core=commands.append)
    channel = RecordingChannel("ch")
    request = EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=4))
    fanout.add(channel, [request])
    fanout.add(channel, [request])
    assert commands == [[request]]  # the duplicate never reaches the engine
    [refusal] = channel.sent[0]
    assert isinstance(refusal, Refusal) and isinstance(refusal.error, InvalidRequestError)
    fanout.close(channel)
    assert commands[1:] == [Abort("r")] and not fanout.channel_of


def test_a_caller_that_does_not_read_gets_its_outputs_merged_not_queued():
    """A backed-up channel holds its outputs, one merged delta per request, and sends them once
    its caller has taken what was written: the step loop never waits, the buffer stays bounded."""
    async def scenario():
        fanout = Fanout("b", to_core=lambda command: None)
        writer = _FakeWriter()
        channel = RecordingChannel("ch", writer)
        fanout.add(channel, [EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=4))])
        fanout.on_step([("r", 2, 0.0)], [], [RequestOutput("r", [7], "a", False, None, Usage(2, 1, 0))])
        assert [type(i).__name__ for i in channel.sent[-1]] == ["Admitted"]
        writer.unsent = MAX_UNSENT_BYTES + 1  # the caller stops reading
        for n in range(2, 5):
            fanout.on_step([], [], [RequestOutput("r", [7], "a", n == 4, "length" if n == 4 else None, Usage(2, n, 0))])
        assert len(channel.sent) == 1  # nothing more written while backed up
        writer.unsent = 0
        writer.drained.set()
        for _ in range(10):
            await asyncio.sleep(0)
        [merged] = channel.sent[-1]
        assert merged.new_token_ids == [7, 7, 7] and merged.new_text == "aaa" and merged.finished

    run(scenario())


def test_a_batch_that_does_not_encode_closes_the_wire_instead_of_stalling_it():
    error = ValueError("carries a lambda")
    error.callback = lambda: None  # pickling the exception fails on it
    writer = _FakeWriter()
    ChannelState("ch", writer).send([Refusal("r", error)])
    assert writer.closed and writer.written == []  # its caller sees the wire close


class RecordingChannel(ChannelState):
    """A channel whose batches are recorded instead of written to a socket."""

    def __init__(self, channel_id: str, writer=None) -> None:
        super().__init__(channel_id, writer)
        self.sent: list = []

    def send(self, items: list) -> None:
        self.sent.append(items)


class _FakeWriter:
    def __init__(self) -> None:
        self.unsent = 0
        self.drained = asyncio.Event()
        self.transport = self
        self.written: list = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return self.unsent

    async def drain(self) -> None:
        await self.drained.wait()
