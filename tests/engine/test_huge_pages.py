"""Weights moved onto huge pages: same values, 2 MB aligned, shared tensors still shared."""

import pytest
import torch
from torch import nn

from tandem.engine.model import huge_pages
from tandem.engine.model.huge_pages import HUGE_PAGE, huge_page_copy, move_to_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")


@needs_thp
def test_copy_is_equal_and_aligned():
    t = torch.randn(300, 1000)
    copy = huge_page_copy(t)
    assert torch.equal(copy, t) and copy.data_ptr() % HUGE_PAGE == 0 and copy.data_ptr() != t.data_ptr()


@needs_thp
def test_move_keeps_values_and_ties():
    embed = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = embed.weight  # tied, as a small model's head is
    model = nn.ModuleDict({"embed": embed, "head": head, "small": nn.Linear(4, 4)})
    model.register_buffer("table", torch.arange(2048, dtype=torch.int64))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    small_ptr = model["small"].weight.data_ptr()

    moved = move_to_huge_pages(model, min_bytes=4096)

    assert moved == 64 * 32 * 4 + 2048 * 8  # the tied weight once, the buffer once, the small layer not at all
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert model["head"].weight is model["embed"].weight
    assert model["embed"].weight.data_ptr() % HUGE_PAGE == 0 and model.table.data_ptr() % HUGE_PAGE == 0
    assert model["small"].weight.data_ptr() == small_ptr
    x = torch.randn(3, 32)
    assert torch.equal(model["head"](x), x @ before["embed.weight"].t())


def test_nothing_moves_without_thp(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    layer = nn.Linear(1024, 1024)
    ptr = layer.weight.data_ptr()
    assert move_to_huge_pages(layer) == 0 and layer.weight.data_ptr() == ptr


@needs_thp
def test_a_failed_mapping_leaves_the_tensor_where_it_is(monkeypatch):
    def no_memory(tensor):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "huge_page_copy", no_memory)
    layer = nn.Linear(1024, 1024)
    ptr = layer.weight.data_ptr()
    assert move_to_huge_pages(layer) == 0 and layer.weight.data_ptr() == ptr
