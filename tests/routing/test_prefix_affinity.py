"""The prefix-affinity policy: prefix key, rendezvous home, bounded-load spill, CPU exclusion."""

import math

import pytest

from tandem.routing import BackendScore, BackendSpec, RateProfile, RouteRequest, Router
from tandem.routing.policies import (PrefixAffinityConfig, PrefixAffinityPolicy, prefix_key,
                                     rendezvous_weight)

SAME = RateProfile(10_000, 1_000)


def score(backend_id: str, load: int = 0, kind: str = "cuda") -> BackendScore:
    return BackendScore(backend_id, kind, 0, 0, 0, 0.0, 0.0, 0.0, load, 0, max_active=4)


def request(block_hashes: tuple[int, ...], req_id: str = "r") -> RouteRequest:
    return RouteRequest(req_id, 16 * len(block_hashes) + 1, 8, block_hashes=block_hashes, block_size=16)


def home_of(key: int, backend_ids: list[str]) -> str:
    return max(backend_ids, key=lambda b: rendezvous_weight(key, b))


def test_prefix_key_is_the_chained_hash_of_the_first_blocks_or_fewer():
    assert prefix_key(request((11, 12, 13, 14)), 2) == 12
    assert prefix_key(request((11,)), 2) == 11  # a shorter prompt: all of its blocks
    assert prefix_key(RouteRequest("r", 10, 8), 2) is None  # no full block
    assert prefix_key(None, 2) is None


def test_rendezvous_weights_are_fixed_numbers():
    """blake2b, not Python's salted str hash: the same home in every process and run."""
    assert rendezvous_weight(12, "cuda0") == 1997813657810302537
    assert rendezvous_weight(12, "cuda1") == 10293119887244252580
    assert [home_of(key, ["cuda0", "cuda1", "cuda2"]) for key in range(8)] == \
        ["cuda1", "cuda1", "cuda2", "cuda2", "cuda2", "cuda1", "cuda1", "cuda0"]


def test_exact_choices_go_home():
    policy = PrefixAffinityPolicy(PrefixAffinityConfig(num_prefix_blocks=2))
    scores = [score("cuda0"), score("cuda1"), score("cuda2")]
    # Key = the second block's hash, whatever follows it.
    assert policy.choose(scores, request((5, 2))) == policy.choose(scores, request((5, 2, 99, 98))) == "cuda2"
    assert policy.choose(scores, request((5, 0))) == "cuda1"
    assert policy.choose(scores, request((5, 7))) == "cuda0"


def test_removing_a_backend_moves_only_the_keys_it_was_home_to():
    three, two = ["cuda0", "cuda1", "cuda2"], ["cuda0", "cuda1"]
    moved = [key for key in range(200) if home_of(key, three) != home_of(key, two)]
    assert moved and all(home_of(key, three) == "cuda2" for key in moved)


def test_bounded_load_spills_to_the_least_loaded():
    policy = PrefixAffinityPolicy(PrefixAffinityConfig(num_prefix_blocks=2, load_factor=1.25))
    req = request((5, 2))  # home: cuda2
    # 3 candidates, total load 6: bound = ceil(1.25 * 7 / 3) = 3; the home may reach 3.
    assert math.ceil(1.25 * 7 / 3) == 3
    assert policy.choose([score("cuda0", 3), score("cuda1", 1), score("cuda2", 2)], req) == "cuda2"
    assert policy.choose([score("cuda0", 3), score("cuda1", 0), score("cuda2", 3)], req) == "cuda1"
    # Ties among the least loaded go to the first in preference order.
    assert policy.choose([score("cuda0", 0), score("cuda1", 0), score("cuda2", 6)], req) == "cuda0"
    # A larger factor keeps it home.
    loose = PrefixAffinityPolicy(PrefixAffinityConfig(num_prefix_blocks=2, load_factor=3.0))
    assert loose.choose([score("cuda0", 3), score("cuda1", 0), score("cuda2", 3)], req) == "cuda2"


def test_cpu_is_a_home_only_without_accelerators():
    policy = PrefixAffinityPolicy(PrefixAffinityConfig(num_prefix_blocks=2))
    req = request((5, 1))
    assert home_of(1, ["cuda0", "cpu0"]) == "cpu0"  # the CPU would win the rendezvous ...
    assert policy.choose([score("cuda0"), score("cpu0", kind="cpu")], req) == "cuda0"  # ... but is skipped
    assert policy.choose([score("cpu0", kind="cpu"), score("cpu1", kind="cpu")], req) == \
        home_of(1, ["cpu0", "cpu1"]) == "cpu1"


def test_a_prompt_without_full_blocks_goes_to_the_least_loaded():
    policy = PrefixAffinityPolicy()
    assert policy.choose([score("cuda0", 2), score("cuda1", 1)], RouteRequest("r", 5, 8)) == "cuda1"


def test_config_is_checked():
    with pytest.raises(ValueError, match="num_prefix_blocks"):
        PrefixAffinityConfig(num_prefix_blocks=0)
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAffinityConfig(load_factor=0.9)


def test_through_the_router_two_tenants_stay_home_until_the_bound():
    router = Router([BackendSpec("cuda0", "cuda", SAME), BackendSpec("cuda1", "cuda", SAME)],
                    policy="prefix-affinity", prefix_affinity=PrefixAffinityConfig(num_prefix_blocks=2))
    assert home_of(0, ["cuda0", "cuda1"]) == "cuda1" and home_of(3, ["cuda0", "cuda1"]) == "cuda0"
    tenant_a, tenant_b = (5, 0, 7), (5, 3, 7)
    chosen = [router.route(request(tenant_a, f"a{n}")).backend_id for n in range(4)]
    # Loads (cuda0, cuda1) before each: (0,0) bound 1 -> home; (0,1) bound 2 -> home;
    # (0,2) bound 2 -> spill; (1,2) bound 3 -> home.
    assert chosen == ["cuda1", "cuda1", "cuda0", "cuda1"]
    assert router.route(request(tenant_b, "b0")).backend_id == "cuda0"
