"""`tandem serve --address`: joining an existing multi-node Ray cluster places CPU backends on
different nodes, and requests still route and stream; under `cost` and `prefix-affinity` alike,
a prefix's later requests follow it to the backend on the other node that holds it and hit its
cache (the router's mirror hears from every node the same way).

The cluster is Ray's own test cluster (`ray.cluster_utils.Cluster`): a head and a worker node,
each a real raylet, both on loopback. It runs in a subprocess because the rest of the cluster
suite holds a Ray instance in this process.
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, pathlib, sys, tempfile, time
    import ray
    from ray.cluster_utils import Cluster
    from tandem import cluster
    from tandem.engine.sampling_params import SamplingParams

    ray_cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    ray_cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray_cluster.wait_for_nodes()
    tmp = pathlib.Path(tempfile.mkdtemp())
    (tmp / "rates.json").write_text(json.dumps({"cpu": {"prefill_tok_s": 500.0, "decode_tok_s": 50.0}}))
    tandem = cluster.start(address=ray_cluster.address, model="tiny-llama-random", backends=["cpu", "cpu"],
                           cpu_threads=1, serve_http=False, rates=str(tmp / "rates.json"),
                           rates_cache=str(tmp / "rates-cache.json"), profile="never",
                           routing_log=str(tmp / "routing.jsonl"), log=lambda line: None)
    def settled():  # the router has heard every earlier request finish (reports are batched)
        for _ in range(200):
            pending = ray.get(tandem.router.pending_summary.remote())
            if all(s["num_active"] + s["num_queued"] == 0 for s in pending.values()):
                return
            time.sleep(0.01)
        raise AssertionError(f"the router still counts requests: {pending}")

    try:
        infos = ray.get([b.info.remote() for b in tandem.backends.values()])
        outs = list(tandem.generate([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0)))
        prefix_runs = {}
        for n, policy in enumerate(["cost", "prefix-affinity"]):
            ray.get(tandem.router.set_policy.remote(policy))
            prefix = [10 + n] + [20 + (i * 7 + n) % 90 for i in range(159)]  # 10 full blocks, one per policy
            cached = []
            for i in range(3):
                settled()  # sequential requests on an idle cluster: the policy's load bound stays out of it
                outs_i = list(tandem.generate(prefix + [100 + i, 101 + i], SamplingParams(max_tokens=2, temperature=0.0)))
                cached.append(outs_i[-1].usage.cached_tokens)
            decisions = [json.loads(line) for line in (tmp / "routing.jsonl").read_text().splitlines()][-3:]
            prefix_runs[policy] = {"cached": cached, "policies": [d["policy"] for d in decisions],
                                   "backends": [d["backend_id"] for d in decisions]}
        print("RESULT " + json.dumps({
            "prefix_runs": prefix_runs,
            "cluster_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            "backend_nodes": sorted(i.node_id for i in infos),
            "num_tokens": sum(len(o.new_token_ids) for o in outs),
            "finished": outs[-1].finished,
        }))
    finally:
        tandem.shutdown()
        ray_cluster.shutdown()
""")


def test_joined_cluster_places_cpu_backends_on_different_nodes():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert len(result["cluster_nodes"]) == 2
    assert result["backend_nodes"] == result["cluster_nodes"]  # one backend on each node
    assert result["num_tokens"] == 4 and result["finished"]
    for policy, run in result["prefix_runs"].items():
        assert run["policies"] == [policy] * 3
        assert len(set(run["backends"])) == 1, run  # the prefix's later requests follow it
        assert run["cached"] == [0, 160, 160], run  # and hit it on that backend, whichever node it is on
