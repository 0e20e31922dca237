"""Fixed choices: the router tells callers the one backend every request goes to, callers send
requests there without asking and note them after, and late notes of ended requests are dropped.

The router is a plain `RouterActor` object (no Ray), its backends fakes; the caller's view
(`FixedChoice`) runs against a fake router handle. The real actors and Serve take this path in
the HTTP smoke run of tests/bench/test_bench_served_path.py, which turns it on."""

from __future__ import annotations

import asyncio

from test_router_actor import FakeBackend, make_router, progress, run

from tandem.cluster.fixed_choice import FixedChoice

PROMPT = list(range(64))


def test_the_watch_answers_at_once_when_stale_and_otherwise_when_routing_changes(tmp_path):
    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        assert await router.watch_fixed_choice(-1, 0.01) == (0, None, None)  # no backend yet
        await router.add_backend(gpu.info("cuda"), gpu)
        version, backend_id, instance_id = await router.watch_fixed_choice(0)
        assert (backend_id, instance_id) == ("cuda0", "i1")
        assert await router.watch_fixed_choice(version, 0.01) == (version, "cuda0", "i1")  # no change: timeout
        waiting = asyncio.ensure_future(router.watch_fixed_choice(version))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await router.add_backend(cpu.info("cpu"), cpu)  # two backends: the router decides again
        version, backend_id, _ = await asyncio.wait_for(waiting, 5)
        assert backend_id is None
        await router.set_policy("cost", cordoned=["cpu0"])
        assert (await router.watch_fixed_choice(version))[1] == "cuda0"
        await router.backend_failed("cuda0", "i1")
        assert (await router.watch_fixed_choice(-1))[1] is None  # only a cordoned one is left

    run(scenario())


def test_a_note_places_the_request_as_place_would(tmp_path):
    async def scenario():
        router, gpu, _ = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.note_placed_many([("a", PROMPT, 16, 1), ("b", PROMPT, 16, 1)])
        pending = await router.pending_summary()
        assert pending["cuda0"]["num_queued"] == 2
        await router.report("cuda0", "i1", [progress("a", "finished", prompt=64, max_tokens=16)])
        await router.forget("b")
        pending = await router.pending_summary()
        assert pending["cuda0"]["num_queued"] + pending["cuda0"]["num_active"] == 0
        log = (tmp_path / "routing.jsonl").read_text().splitlines()
        assert len(log) == 2  # both decisions are in the routing log

    run(scenario())


def test_a_late_note_of_a_request_that_already_ended_is_dropped(tmp_path):
    async def scenario():
        router, gpu, _ = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.report("cuda0", "i1", [progress("early", "finished", prompt=64, max_tokens=16)])
        assert not router._tombstones  # nobody watches the fixed choice: no note can come
        assert (await router.watch_fixed_choice(-1))[1] == "cuda0"  # a caller that will send notes
        # The backend's "finished" report, and a caller's forget, overtook their notes.
        await router.report("cuda0", "i1", [progress("done", "finished", prompt=64, max_tokens=16)])
        await router.forget("gave-up")
        await router.note_placed_many([("done", PROMPT, 16, 1), ("gave-up", PROMPT, 16, 1), ("new", PROMPT, 16, 1)])
        pending = await router.pending_summary()
        assert pending["cuda0"]["num_queued"] == 1  # only "new": no entry outlives its request
        assert not router._tombstones  # each tombstone served its purpose once

    run(scenario())


class FakeRouter:
    """A router handle whose watch answers from a queue and whose notes are recorded."""

    def __init__(self):
        self.answers: asyncio.Queue = asyncio.Queue()
        self.notes: list[list] = []
        self._actor_id = object()
        router = self

        class Watch:
            def remote(self, version):
                return router.answers.get()

        class Note:
            def remote(self, batch):
                router.notes.append(batch)

        self.watch_fixed_choice, self.note_placed_many = Watch(), Note()


def test_the_callers_view_follows_the_router_and_notes_in_one_call_per_turn():
    async def scenario():
        router = FakeRouter()
        view = FixedChoice.of(router)
        assert FixedChoice.of(router) is view  # one per event loop and router
        assert view.place("r0", PROMPT, 8) is None  # no answer yet: ask the router
        await router.answers.put((1, "cuda0", "i1"))
        await asyncio.sleep(0)
        assert view.place("r1", PROMPT, 8) == ("cuda0", "i1")
        assert view.place("r2", PROMPT, 8) == ("cuda0", "i1")
        await asyncio.sleep(0)
        assert router.notes == [[("r1", PROMPT, 8, 1), ("r2", PROMPT, 8, 1)]]
        await router.answers.put((2, None, None))
        await asyncio.sleep(0)
        assert view.place("r3", PROMPT, 8) is None
        await asyncio.sleep(0)
        assert len(router.notes) == 1  # nothing noted for a request the router places itself

    run(scenario())


def test_a_dead_router_leaves_every_request_to_ask_it():
    async def scenario():
        router = FakeRouter()
        view = FixedChoice.of(router)
        await router.answers.put((1, "cuda0", "i1"))
        await asyncio.sleep(0)
        assert view.place("r0", PROMPT, 8) is not None

        async def dead(version):
            raise RuntimeError("the router died")

        router.watch_fixed_choice.remote = dead
        await router.answers.put((2, "cuda0", "i1"))  # the next answer is followed by a failed call
        for _ in range(3):
            await asyncio.sleep(0)
        assert view.place("r1", PROMPT, 8) is None

    run(scenario())
