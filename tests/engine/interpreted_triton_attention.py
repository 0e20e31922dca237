"""Run under TRITON_INTERPRET=1 (tests/engine/test_triton_attention_interpreted.py does): the
Triton paged attention, on the CPU through Triton's interpreter, against the reference path on
every kind of step: pure decode, mixed with and without decode rows, short and long contexts
(split over several programs or not), and the same steps as a CUDA graph's mixed bucket holds
them (padded rows, a work list). Prints one line per case with the splits each launch used, and
exits 1 on a mismatch or where no launch of a long-context case split.

The K/V write is the reference path's: Triton's interpreter rejects the write kernel's mask (a
scalar condition broadcast over the tile), which the GPU compiles; the attention kernels run as
written."""

import dataclasses
import math
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import build_step  # noqa: E402

from tandem.engine.attention import TorchRefAttention, torch_ref  # noqa: E402
from tandem.engine.attention import triton_paged as tp  # noqa: E402
from tandem.engine.cuda_graphs import build_work_list  # noqa: E402

tp.write_kv_cache = lambda k, v, cache, slots: torch_ref.write_kv_cache(k, v, cache, slots, False)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 512
CASES = {  # (cached, new) tokens per request, in the scheduler's order (decodes first)
    "decode only": [(9, 1), (30, 1), (17, 1)],
    "mixed, decodes of long contexts beside prompts": [(40, 1), (130, 1), (0, 5), (12, 3)],
    "mixed, no decode rows": [(0, 7), (5, 20)],
    "mixed, one-token prefill chunk after a prompt": [(40, 1), (0, 6), (100, 1)],
    "a suffix over a long cached prefix": [(300, 12)],
    "long decodes beside a suffix over a long prefix": [(300, 1), (250, 1), (280, 20)],
    "a long fresh prompt": [(0, 200)],
}
LONG = {"a suffix over a long cached prefix", "long decodes beside a suffix over a long prefix", "a long fresh prompt"}

splits_used: list[int] = []
_num_context_splits = tp.num_context_splits
tp.num_context_splits = lambda *args: splits_used.append(_num_context_splits(*args)) or splits_used[-1]


def graph_metadata(meta, query_lens: list[int], num_tokens: int, pad_rows: int = 3):
    """`meta` as a CUDA graph's mixed bucket holds it: padded rows (no tokens, a context of one
    token in block 0) and a work list with spare items of -1."""
    block_q = tp.prefill_block_q(NUM_HEADS // NUM_KV_HEADS)
    work = build_work_list(query_lens, block_q)
    num_items = len(work) // 2 + 4
    rows = len(query_lens) + pad_rows
    tables = torch.cat([meta.block_tables, torch.zeros(pad_rows, meta.block_tables.shape[1],
                                                       dtype=meta.block_tables.dtype)])
    return dataclasses.replace(
        meta, query_start_loc=torch.tensor(meta.query_start_loc.tolist() + [num_tokens] * pad_rows, dtype=torch.int32),
        seq_lens=torch.tensor(meta.seq_lens.tolist() + [1] * pad_rows, dtype=torch.int32), block_tables=tables,
        query_lens_cpu=[1] * rows, seq_lens_cpu=[1] * rows,
        work_list=torch.tensor(work + [-1] * (2 * num_items - len(work)), dtype=torch.int32).view(num_items, 2))


def main() -> int:
    torch.manual_seed(0)
    scale = 1 / math.sqrt(HEAD_DIM)
    failed = 0
    for name, reqs in CASES.items():
        cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        _, meta = build_step(reqs, BLOCK_SIZE)
        num_tokens = sum(n for _, n in reqs)
        q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
        k, v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM), torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        expected = TorchRefAttention().forward(q, k, v, cache.clone(), meta, scale)
        graph = graph_metadata(meta, [n for _, n in reqs], num_tokens)
        for how, step in (("eager", meta), ("graph", graph)):
            splits_used.clear()
            out = tp.TritonPagedAttention().forward(q, k, v, cache.clone(), step, scale)
            error = (out - expected).abs().max().item()
            ok = error < 1e-4 and (name not in LONG or max(splits_used, default=1) > 1)
            failed += not ok
            print(f"{'ok ' if ok else 'BAD'} {name}, {how}: max |error| {error:.2e}, splits {splits_used or '-'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
