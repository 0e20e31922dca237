"""BackendActor as a plain object (no Ray): its engine thread, streams, aborts and cache queries.

The actor class is ordinary Python until the launcher wraps it with `ray.remote`, so its
concurrency logic is tested here in-process with the tiny random model, in seconds.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.actors.backend import BackendActor
from tandem.actors.messages import Admitted
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams

ENGINE = dict(model="tiny-llama-random", device="cpu", max_active=4, block_size=16)


class FakeRouter:
    """Collects `report.remote(...)` calls made from the engine thread."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, str, list]] = []
        self.cache_changes: dict[int, bool] = {}
        self.report = self

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


async def collect(actor, req_id, ids, params):
    items = [item async for item in actor.generate(req_id, ids, params)]
    assert isinstance(items[0], Admitted) and items[0].num_prompt_tokens == len(ids)
    return items[1:]


def test_generate_streams_deltas_and_finishes(backend):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = run(collect(backend, "a", list(range(10, 30)), params))
    # Steps' tokens may share a message (stream_interval_s, or a consumer that fell behind),
    # but none is lost and no message is empty.
    assert sum(len(o.new_token_ids) for o in outs) == 6 and all(o.new_token_ids for o in outs)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])


def test_waiting_outputs_merge_into_one_message_and_an_error_stops_the_merge():
    from tandem.actors.backend import _coalesce
    from tandem.engine.outputs import RequestOutput, Usage

    def out(token, text, done=False):
        return RequestOutput("m", [token], text, done, "length" if done else None, Usage(3, token, 0))

    async def drain(items):
        queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        first = await queue.get()
        merged, error = _coalesce(first, queue)
        assert len(merged) == 1  # one choice: one message
        return (merged[0], error), queue.qsize()

    (merged, error), left = run(drain([out(1, "a"), out(2, "b"), out(3, "c", done=True), out(9, "x")]))
    assert merged.new_token_ids == [1, 2, 3] and merged.new_text == "abc"
    assert merged.finished and merged.usage.completion_tokens == 3 and error is None and left == 1
    boom = RuntimeError("backend died")
    (merged, error), left = run(drain([out(1, "a"), out(2, "b"), boom, out(3, "c")]))
    assert merged.new_token_ids == [1, 2] and error is boom and left == 1


def test_concurrent_streams_interleave_and_match_solo_greedy(backend):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = {f"c{i}": list(range(40 + 7 * i, 60 + 7 * i)) for i in range(3)}

    async def run_all():
        return await asyncio.gather(*(collect(backend, r, ids, params) for r, ids in prompts.items()))

    together = run(run_all())
    solo = [run(collect(backend, f"solo-{r}", ids, params)) for r, ids in prompts.items()]
    for batched, alone in zip(together, solo):
        assert [t for o in batched for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]


def test_rejected_request_raises_before_admitted(backend):
    params = SamplingParams(max_tokens=5000, temperature=0.0)

    async def first():
        return await backend.generate("too-long", [1, 2, 3], params).__anext__()

    with pytest.raises(InvalidRequestError, match="context length"):
        run(first())


def test_closing_a_stream_aborts_and_frees_blocks(backend):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def read_two_then_close():
        gen = backend.generate("abandoned", list(range(5, 60)), params)
        assert isinstance(await gen.__anext__(), Admitted)
        await gen.__anext__()
        await gen.aclose()  # what Ray does when the caller cancels the stream
        for _ in range(100):
            stats = await backend.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = run(read_two_then_close())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0


def test_abort_ends_the_stream_with_reason_abort(backend):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def abort_midway():
        gen = backend.generate("to-abort", list(range(70, 90)), params)
        await gen.__anext__()
        assert await backend.abort("to-abort")
        return [item async for item in gen]

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
    actor.router = router  # set after start: outside Ray there is no registration to do
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
    actor.router = router
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


def test_pacing_sends_the_first_token_at_once_then_one_message_per_interval():
    """With a long interval, a 12-token stream arrives as the first token alone, then the rest in
    few messages; a message budget stretches the interval with the number of streams, but never
    past the 20 ms bound on how long a stream's tokens may wait."""
    actor = BackendActor("cpu1", ENGINE, threads=1, stream_interval_s=10.0)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = run(collect(actor, "p", list(range(10, 30)), params))
        assert [len(o.new_token_ids) for o in outs] == [1, 11]  # the finished output is never held
        assert outs[-1].finished
        capped = BackendActor.__new__(BackendActor)
        capped.stream_interval_s, capped.max_stream_messages_per_s = 0.01, 500.0
        capped._streams = {f"r{i}": None for i in range(8)}
        assert capped._stream_interval() == pytest.approx(8 / 500)
        capped._streams = {f"r{i}": None for i in range(48)}
        assert capped._stream_interval() == pytest.approx(0.02)
        capped.max_stream_messages_per_s = 0.0
        assert capped._stream_interval() == 0.01
    finally:
        run(actor.shutdown())


async def _channel_run(actor, channel_id, requests):
    """Add `requests` ((req_id, ids, params)) on one channel; returns each one's Admitted (which
    the channel brings first) and the packed outputs the channel brought for it after."""
    from tandem.actors.messages import Admitted

    batches: list = []

    async def read() -> None:
        async for batch in actor.subscribe(channel_id):
            batches.extend(batch)

    reader = asyncio.get_running_loop().create_task(read())
    assert await actor.add_many(channel_id, [(req_id, ids, params, None) for req_id, ids, params in requests]) is None
    pending = {req_id for req_id, _, _ in requests}
    while pending:
        await asyncio.sleep(0.01)
        pending -= {t[0] for t in batches if len(t) > 2 and t[3]}
        pending -= {t[0] for t in batches if len(t) == 2 and t[1].outputs and t[1].outputs[-1][3]}
    reader.cancel()
    admitted: dict = {}
    for item in batches:
        if len(item) == 2:
            assert isinstance(item[1], Admitted) and item[0] not in admitted, item  # one admission each
            admitted[item[0]] = item[1]
    outputs = [t for t in batches if len(t) > 2]
    for req_id in admitted:  # a request's admission comes before its outputs
        places = [i for i, t in enumerate(batches) if t[0] == req_id]
        assert len(batches[places[0]]) == 2, batches
    return [admitted[r] for r, _, _ in requests], {r: [t for t in outputs if t[0] == r] for r, _, _ in requests}


def test_a_channel_add_brings_the_first_token_and_the_channel_the_rest(backend):
    """The admission carries the outputs of the step that admitted the request (its first
    token, here all of a one-token request); the channel brings the rest, none twice."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = list(range(40, 60))
    solo = [t for o in run(collect(backend, "solo", ids, greedy)) for t in o.new_token_ids]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    admitted, by_req = run(_channel_run(backend, "ch-test", [("c6", ids, greedy), ("c1", ids, one)]))
    six, single = admitted
    assert six.outputs and not six.outputs[-1][3]  # the first token came with the admission
    assert six.received_time <= six.queued_time  # the add's hops, stamped
    assert [t for o in six.outputs + by_req["c6"] for t in o[1]] == solo
    assert single.outputs[-1][3] and single.outputs[-1][1] == solo[:1] and by_req["c1"] == []


def test_a_rejected_channel_add_is_answered_on_the_channel(backend):
    from tandem.actors.messages import Admitted

    async def scenario():
        batches: list = []

        async def read() -> None:
            async for batch in backend.subscribe("ch-bad"):
                batches.extend(batch)

        reader = asyncio.get_running_loop().create_task(read())
        too_long = SamplingParams(max_tokens=10**6, temperature=0.0)
        eight = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        await backend.add_many("ch-bad", [("bad", [5, 6], too_long, None), ("ok", [5, 6], eight, None)])
        await backend.add_many("ch-bad", [("ok", [5, 6], eight, None)])  # a duplicate id, while "ok" runs
        while not any(len(i) > 2 and i[0] == "ok" and i[3] for i in batches):
            await asyncio.sleep(0.01)
        reader.cancel()
        return batches

    batches = run(scenario())
    answers = [i for i in batches if len(i) == 2]
    kinds = sorted((req_id, type(answer).__name__) for req_id, answer in answers)
    assert kinds == [("bad", "InvalidRequestError"), ("ok", "Admitted"), ("ok", "InvalidRequestError")]
    admitted = next(a for _, a in answers if isinstance(a, Admitted))
    tokens = [t for o in admitted.outputs for t in o[1]] + [t for i in batches if len(i) > 2 for t in i[1]]
    assert len(tokens) == 8  # the running request lost nothing to the refused duplicate


def test_the_wire_admits_streams_and_aborts_on_hang_up(backend):
    """The same-node wire carries what add_many + subscribe carry (admission first, then the
    outputs, the tokens of a solo run), and a caller hanging up aborts its unfinished requests."""
    from tandem.actors import wire

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    endless = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    ids = list(range(70, 90))
    solo = [t for o in run(collect(backend, "wire-solo", ids, greedy)) for t in o.new_token_ids]

    async def scenario():
        _, address = await backend.wire_address()
        reader, writer = await wire.connect(address)
        writer.write(wire.encode("ch-wire"))
        writer.write(wire.encode([("w6", ids, greedy, None), ("w-long", ids, endless, None)]))
        items: list = []
        while not any(len(i) > 2 and i[0] == "w6" and i[3] for i in items):
            items.extend(await wire.read_frame(reader))
        writer.close()  # hang up with w-long still running
        while backend._channel_of:  # the hang-up took w-long out of the channel...
            await asyncio.sleep(0.01)
        while (await backend.stats()).num_running:  # ...and aborted it in the engine
            await asyncio.sleep(0.01)
        return items

    items = run(scenario())
    import ray

    assert not ray.is_initialized()  # asking for the node id outside Ray must not start Ray
    mine = [i for i in items if i[0] == "w6"]
    admitted = mine[0][1]  # the admission comes first
    assert len(mine[0]) == 2 and isinstance(admitted, Admitted) and admitted.num_prompt_tokens == len(ids)
    tokens = [t for o in admitted.outputs for t in o[1]] + [t for i in items if len(i) > 2 and i[0] == "w6"
                                                            for t in i[1]]
    assert tokens == solo
    assert "ch-wire" not in backend._channels


@pytest.fixture()
def front_text_backend(monkeypatch):
    monkeypatch.setenv("TANDEM_FRONT_DETOKENIZE", "1")
    actor = BackendActor("cpu-text", ENGINE, threads=1)
    yield actor
    run(actor.shutdown())


def test_the_front_makes_the_text_and_a_stop_string_stops_the_engine(front_text_backend):
    """The core sends token ids only; the front's text is what the engine would have made (the
    same request through an engine that detokenizes), and a stop string found by the front
    ends the stream with "stop" and aborts the request in the core."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    ids = list(range(30, 50))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    backend = front_text_backend
    engine = LLMEngine(EngineConfig(**ENGINE))
    engine.add_request("ref", ids, greedy)
    reference = []
    while engine.has_unfinished_requests():
        reference += engine.step()
    text = "".join(o.new_text for o in reference)
    assert backend._text is not None and text
    served = run(collect(backend, "text", ids, greedy))
    assert "".join(o.new_text for o in served) == text

    stop = text[len(text) // 2: len(text) // 2 + 2]  # two characters from the middle of the text
    stopped = run(collect(backend, "stop", ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                               stop=[stop])))
    assert "".join(o.new_text for o in stopped) == text[: text.index(stop)]
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"

    async def engine_idle():
        while (await backend.stats()).num_running:
            await asyncio.sleep(0.01)

    run(engine_idle(), timeout_s=30)  # the core was told: nothing left running


def test_an_admission_waits_for_first_outputs_that_come_a_step_later():
    """With asynchronous scheduling a step's tokens come with the next step's message: the
    admission is held for them one message, no longer, and a rejection is not held at all."""
    from tandem.actors import engine_core as core
    from tandem.actors.backend import _Channel
    from tandem.actors.messages import Admitted
    from tandem.engine.outputs import RequestOutput, Usage

    actor = BackendActor.__new__(BackendActor)  # the bookkeeping only: no engine core
    actor.backend_id = "b"
    actor._text = None
    channel = _Channel()
    channel.req_ids.update({"r", "s"})
    actor._admitting = {7: ("r", channel, 1.0), 8: ("s", channel, 1.0)}
    actor._awaiting_first, actor._channel_of = {}, {"r": channel, "s": channel}
    error = InvalidRequestError("too long")
    other_reply = (3, True, None)  # not an add: answered as before
    replies, rest, admissions = actor._admissions([(7, True, (20, 2.0)), (8, False, error), other_reply], [])
    assert replies == [other_reply] and rest == [] and admissions[id(channel)][1] == [("s", error)]
    assert "s" not in actor._channel_of  # a rejected request leaves its channel
    first = core.pack_output(RequestOutput("r", [5], "x", False, None, Usage(20, 1, 0)))
    other = core.pack_output(RequestOutput("q", [6], "y", False, None, Usage(3, 1, 0)))
    replies, rest, admissions = actor._admissions([], [first, other])
    assert replies == [] and rest == [other]
    assert admissions[id(channel)][1] == [("r", Admitted("r", "b", 20, [first], 1.0, 2.0))]
    assert actor._admissions([], [first]) == ([], [first], {})  # admitted: later ones take the channel
    # A request with no output in the next message either (queued) is admitted without outputs.
    actor._admitting[9] = ("s", channel, 1.0)
    assert actor._admissions([(9, True, (5, 2.0))], []) == ([], [], {})
    replies, rest, admissions = actor._admissions([], [other])
    assert rest == [other] and admissions[id(channel)][1] == [("s", Admitted("s", "b", 5, [], 1.0, 2.0))]
    assert not actor._awaiting_first
