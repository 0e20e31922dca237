"""RouterActor hands the prompt's block hashes to the pure router: prefixes it has just sent to
a backend count as cached there until the request finishes, and prefix-affinity can home them."""

from __future__ import annotations

from test_router_actor import FakeBackend, progress, run

from tandem.actors.router import RouterActor


def test_a_burst_of_one_prompt_counts_its_inflight_prefix():
    async def scenario():
        router = RouterActor("cost", None)
        gpu, cpu = FakeBackend("cuda0"), FakeBackend("cpu0")
        await router.add_backend(gpu.info("cuda"), gpu)  # empty caches: the mirror knows nothing
        await router.add_backend(cpu.info("cpu"), cpu)
        prompt = list(range(516))
        first = await router.place("r0", prompt, 128)
        second = await router.place("r1", prompt, 128)
        await router.report("cuda0", "i1", [progress("r0", "finished"), progress("r1", "finished")])
        after = await router.place("r2", prompt, 128)
        return first, second, after

    first, second, after = run(scenario())
    assert first.backend_id == second.backend_id == "cuda0"
    cuda0 = second.record["per_backend"]["cuda0"]
    assert cuda0["num_cached_tokens"] == cuda0["num_inflight_cached_tokens"] == 512  # 32 blocks of 16
    assert after.record["per_backend"]["cuda0"]["num_inflight_cached_tokens"] == 0  # expired


def test_prefix_affinity_through_the_actor_homes_on_the_accelerator():
    async def scenario():
        router = RouterActor("prefix-affinity", None)
        gpu, cpu = FakeBackend("cuda0"), FakeBackend("cpu0")
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        return [(await router.place(f"r{n}", list(range(n, n + 300)), 16)).backend_id for n in range(4)]

    assert run(scenario()) == ["cuda0"] * 4
