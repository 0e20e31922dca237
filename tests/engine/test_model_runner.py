"""The runner's host-side inputs on exact values: decodes and prefill chunks in one flat batch."""

import pytest
import torch

from tandem.engine.model.loader import load_model
from tandem.engine.host_tensors import int_tensor
from tandem.engine.model_runner import ModelRunner
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int_tensor_equals_torch_tensor(dtype):
    values = [0, -1, 7, 2**31 - 1, -(2**31)] + list(range(1000))
    out = int_tensor(values, dtype)
    assert out.dtype == dtype and torch.equal(out, torch.tensor(values, dtype=dtype))
    assert int_tensor([], dtype).shape == (0,) and int_tensor([], dtype).dtype == dtype


def test_prepare_inputs_mixes_decodes_and_prefill_chunks():
    runner = ModelRunner(load_model("tiny-llama-random"), torch.device("cpu"), torch.float32,
                         num_blocks=32, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_active=4, max_num_batched_tokens=10, block_size=BS, num_blocks=32))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    a = Request("a", [11, 12, 13, 14, 15], params)
    b = Request("b", [21, 22, 23], params)
    c = Request("c", list(range(31, 41)), params)
    for request in (a, b):
        sched.add_request(request)
    out = sched.schedule()  # a: 5 tokens in blocks 1-2, b: 3 in block 3
    sched.update_from_output(out, {"a": 16, "b": 24})
    sched.add_request(c)
    out = sched.schedule()  # a, b decode; c prefills 10 - 2 = 8 of its 10 tokens
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 1), ("c", 8)]

    ids, pos, meta = runner.prepare_inputs(out, sched.kv_cache_manager)
    assert ids.tolist() == [16, 24, *range(31, 39)]
    assert pos.tolist() == [5, 3, *range(8)]
    # a: position 5 in its 2nd block (2); b: position 3 in block 3; c: blocks 4 and 5.
    assert meta.slot_mapping.tolist() == [2 * BS + 1, 3 * BS + 3, *range(4 * BS, 6 * BS)]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 10]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [6, 4, 8]
    assert meta.query_lens_cpu == [1, 1, 8]
    assert meta.block_tables.tolist() == [[1, 2], [3, 0], [4, 5]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64


def test_cuda_graph_inputs_pack_like_nested_torch_tensor():
    """The CUDA-graph runner's host-side packing (CPU code, so it is checked here) equals the
    nested `torch.tensor` construction it replaced."""
    from tandem.engine.cuda_graphs import pack_decode_inputs

    ids, pos, slots, lens, rows = [5, 6, 7], [16, 3, 40], [33, 51, 70], [17, 4, 41], [3, 1, 2]
    packed = pack_decode_inputs(ids, pos, slots, lens, rows, batch_size=4)
    expected = torch.tensor([ids + [0], pos + [0], slots + [-1], lens + [1], rows + [0]], dtype=torch.int64)
    assert torch.equal(packed, expected) and packed.dtype == torch.int64


def test_work_list_covers_every_query_tile():
    from tandem.engine.cuda_graphs import build_work_list, token_buckets

    assert build_work_list([1, 5, 12, 1], 5) == [0, 0, 1, 0, 2, 0, 2, 1, 2, 2, 3, 0]
    assert token_buckets(8192)[:3] == [256, 512, 768] and token_buckets(8192)[-2:] == [7168, 8192]
    assert token_buckets(40) == [40]


def test_block_table_mirror_uploads_only_new_blocks():
    """Rows of the device table follow each request's block list: appended blocks are added,
    a new list (freed and allocated again) is rewritten whole, and rows of requests missing
    from a step are taken back when none is free; row 0 stays zero for padded rows."""
    from tandem.engine.block_table import BlockTableMirror

    mirror = BlockTableMirror(num_rows=3, max_blocks_per_seq=4, device=torch.device("cpu"))
    a, b = [5, 6], [7]
    rows = mirror.rows_for([("a", a), ("b", b)])
    assert rows == [1, 2]
    a.append(8)
    assert mirror.rows_for([("a", a), ("b", b)]) == [1, 2]
    assert mirror.table[1].tolist() == [5, 6, 8, 0] and mirror.table[2].tolist() == [7, 0, 0, 0]
    a2 = [9]  # "a" freed (preempted) and allocated again: a new list
    assert mirror.rows_for([("a", a2)]) == [1]
    assert mirror.table[1, :1].tolist() == [9]
    mirror.rows_for([("c", [1]), ("d", [2])])  # row 3, then one taken back from "a" or "b"
    assert mirror.table[0].tolist() == [0, 0, 0, 0]
    table = mirror.table.clone()
    rows = mirror.rows_for([("c", [1]), ("d", [2])])
    assert torch.equal(mirror.table, table) and len(set(rows)) == 2 and 0 not in rows
