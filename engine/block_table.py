"""The block tables of live requests, kept on the device row by row.

A CUDA-graph step needs each request's block table on the device. Rebuilding and copying every
table every step costs the host ~0.7 ms at 200 requests of ~100 blocks (a padded list of 20k+
ints), while a decode step adds a block to only one request in sixteen. So each request keeps
a row of one device table, a step uploads only the blocks a request gained since its last
step (one scatter), and the graphs gather their batch's rows on the device.

A row belongs to a request while the request's block list is the same list object: the cache
manager makes a new list when a request is freed (finished or preempted) and allocated again,
which re-uploads the whole table into a row. Rows are never released eagerly: when none is
free, rows of requests that are not in the step are taken back. A row reused that way is
rewritten by copies queued after every step already launched, so those steps read what they
were launched with. Row 0 stays all zeros: padded batch rows read the null block.
"""

from __future__ import annotations

import torch

from tandem.engine.host_tensors import to_device


class BlockTableMirror:
    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.table = torch.zeros(num_rows + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._rows: dict[str, tuple[int, list[int], int]] = {}  # req id -> (row, block list, uploaded)
        self._free = list(range(num_rows, 0, -1))

    def rows_for(self, requests: list[tuple[str, list[int]]]) -> list[int]:
        """The row of each (request id, block ids) of a step, after queueing the upload of the
        blocks each gained since it last ran."""
        rows, index, values = [], [], []
        entries = self._rows
        width = self.max_blocks
        for req_id, block_ids in requests:
            entry = entries.get(req_id)
            if entry is not None and entry[1] is block_ids:
                row, _, start = entry
            else:  # new here, or freed and allocated again: the whole table
                row = entry[0] if entry is not None else self._take_row(requests)
                start = 0
            num_blocks = len(block_ids)
            if num_blocks > start:
                base = row * width
                index.extend(range(base + start, base + num_blocks))
                values.extend(block_ids[start:])
                entries[req_id] = (row, block_ids, num_blocks)
            elif entry is None or entry[1] is not block_ids:
                entries[req_id] = (row, block_ids, num_blocks)
            rows.append(row)
        if index:
            packed = to_device(index + values, torch.int64, self.device)
            self.table.view(-1).index_copy_(0, packed[: len(index)], packed[len(index):].to(torch.int32))
        return rows

    def _take_row(self, requests: list[tuple[str, list[int]]]) -> int:
        if not self._free:
            in_step = {req_id for req_id, _ in requests}
            for req_id in [r for r in self._rows if r not in in_step]:
                self._free.append(self._rows.pop(req_id)[0])
        if not self._free:
            raise RuntimeError(f"a step of {len(requests)} requests needs more than {self.table.shape[0] - 1} "
                               "block-table rows")
        return self._free.pop()
