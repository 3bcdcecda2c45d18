import pytest
import torch

from dynaseq.techniques.cct.packing import Packing, scatter_rows


def test_pack_left_per_sequence_and_back():
    on = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]]).bool()
    p = Packing.of(on)
    assert p.rows.tolist() == [0, 2] and p.width == 3
    assert p.pos.tolist() == [[1, 3, 0], [0, 1, 2]]
    assert p.valid.tolist() == [[True, True, False], [True, True, True]]
    assert p.flat.tolist() == [1, 3, 8, 9, 10]
    values = torch.arange(5.0)[:, None]  # one feature per selected token, in flat order
    packed = p.pack(values)
    assert packed[..., 0].tolist() == [[0, 1, 0], [2, 3, 4]]
    assert torch.equal(p.unpack(packed), values)
    full = torch.arange(12.0).view(3, 4, 1)
    assert p.gather(full, 1)[..., 0].tolist() == [[1, 3, 0], [8, 9, 10]]
    assert scatter_rows(values, p.flat, 12).view(3, 4).tolist() == [
        [0, 0, 0, 1], [0, 0, 0, 0], [2, 3, 4, 0]]


def test_restricted_rows_and_empty_selection():
    on = torch.tensor([[1, 1], [1, 0]]).bool()
    p = Packing.of(on, rows=torch.tensor([1]))
    assert p.flat.tolist() == [2] and p.width == 1
    empty = Packing.of(torch.zeros(2, 3, dtype=torch.bool))
    assert empty.n_rows == 0 and empty.width == 0 and empty.flat.numel() == 0
    with pytest.raises(ValueError, match="bool"):
        Packing.of(torch.ones(2, 3))
