"""Shared test fixtures: hand-built attention metadata for a flat varlen step.

Model and attention tests drive a forward without a scheduler, so they need the metadata a
runner would build. Blocks are handed out strided (request i's j-th block is 1 + i + j * B) so a
request's blocks are never contiguous and block 0 is never used: a gather that ignores the
block table, or reads the table's zero padding, gives wrong numbers instead of passing by luck.
"""

from __future__ import annotations

import os

import pytest

# Every Ray process a test starts (actors, Serve, subprocess CLIs) inherits these: usage stats
# stay off and Ray's traffic stays on loopback, whatever command ran pytest.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import torch

from tandem.engine.attention.metadata import AttentionMetadata


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of `a` against the reference `b`, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def build_step(
    reqs: list[tuple[int, int]], block_size: int = 4, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and metadata for requests given as (num_cached_tokens, num_new_tokens)."""
    num_reqs = len(reqs)
    seq_lens = [cached + new for cached, new in reqs]
    tables = [[1 + i + j * num_reqs for j in range(-(-seq // block_size))] for i, seq in enumerate(seq_lens)]
    width = max(len(t) for t in tables)
    positions, slots, starts = [], [], [0]
    for (cached, new), table in zip(reqs, tables):
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + new)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_lens_cpu=[new for _, new in reqs],
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), meta


@pytest.fixture
def make_step():
    """`make_step(reqs, block_size=4, device="cpu") -> (positions, AttentionMetadata)`."""
    return build_step


def greedy_tokens(config, prompts: list[list[int]], max_tokens: int = 12):
    """An engine built from `config` and each prompt's greedy output ids (EOS ignored)."""
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return engine, [out[f"r{i}"] for i in range(len(prompts))]


def is_gone(pid: int) -> bool:
    """The process has exited (a zombie has too: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def build_ggml_or_skip() -> None:
    """Build (once per machine) or load ggml's kernels; skip the calling test, saying why, where
    they cannot be built (no compiler, no package index, a failed build)."""
    import pytest

    from tandem.engine.model import ggml_kernels

    try:
        ggml_kernels.build()  # explicitly: an engine's start never builds ggml itself
        ggml_kernels.load()
    except Exception as exc:
        pytest.skip(f"ggml's kernels could not be built here: {str(exc)[:300]}")
