"""`tandem serve --address`: joining an existing multi-node Ray cluster places CPU backends on
different nodes, and requests still route and stream.

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
    import json, pathlib, sys, tempfile
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
    try:
        infos = ray.get([b.info.remote() for b in tandem.backends.values()])
        outs = list(tandem.generate([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0)))
        print("RESULT " + json.dumps({
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
