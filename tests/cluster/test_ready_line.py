"""The start-up line each loaded backend prints: what it runs, as a user needs to know it."""

from tandem.actors.messages import BackendInfo
from tandem.cluster.launcher import ready_line


def _info(**overrides):
    fields = dict(backend_id="cuda0", instance_id="i", device="cuda:0", device_kind="cuda", requested_device="auto",
                  dtype="bfloat16", threads=1, max_active=256, block_size=16, model_name="m", max_model_len=32768,
                  num_kv_tokens=1_234_560)
    return BackendInfo(**{**fields, **overrides})


def test_accelerator_line_names_device_dtype_concurrency_and_kv_tokens():
    assert ready_line(_info()) == ("backend cuda0 ready: cuda:0, bfloat16, max_active 256, "
                                   "KV cache 1,234,560 tokens (77,160 blocks of 16)")


def test_cpu_line_names_its_kernels():
    line = ready_line(_info(backend_id="cpu0", device="cpu", device_kind="cpu", dtype="float32", max_active=4,
                            num_kv_tokens=65_536, cpu_kernels="torch"))
    assert line == "backend cpu0 ready: cpu, float32, torch kernels, max_active 4, KV cache 65,536 tokens (4,096 blocks of 16)"
