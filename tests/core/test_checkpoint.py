import pytest
import torch
from torch import nn

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.errors import CheckpointError


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def test_write_and_load_round_trip(tmp_path):
    a, b = net(0), net(1)
    ckpt.write_checkpoint(tmp_path / "c", a, {"step": 7}, {"x": torch.ones(2)})
    ckpt.load_weights(b, tmp_path / "c")
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert ckpt.read_meta(tmp_path / "c")["step"] == 7
    assert torch.equal(ckpt.load_trainer_state(tmp_path / "c")["x"], torch.ones(2))
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))


def test_rewrite_replaces_and_listing_is_sorted(tmp_path):
    for step in (20, 3, 100):
        ckpt.write_checkpoint(ckpt.step_dir(tmp_path, step), net(step), {"step": step})
    ckpt.write_checkpoint(ckpt.step_dir(tmp_path, 3), net(5), {"step": 3})
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step_00000003", "step_00000020", "step_00000100"]
    (tmp_path / "checkpoints" / ".tmp-step_00000200").mkdir()  # an interrupted write
    assert len(ckpt.list_checkpoints(tmp_path)) == 3
    ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == names[1:]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_corrupt_weights_raise_checkpoint_error(tmp_path, damage):
    ckpt.write_checkpoint(tmp_path / "c", net(0), {"step": 1}, {"x": torch.ones(3)})
    w = tmp_path / "c" / ckpt.WEIGHTS
    data = w.read_bytes()
    if damage == "truncate":
        w.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        w.write_bytes(b"\x00" * 64)
    else:
        w.unlink()
    with pytest.raises(CheckpointError):
        ckpt.load_weights(net(1), tmp_path / "c")


def test_truncated_trainer_state_raises(tmp_path):
    ckpt.write_checkpoint(tmp_path / "c", net(0), {"step": 1}, {"x": torch.ones(3)})
    t = tmp_path / "c" / ckpt.TRAINER
    t.write_bytes(t.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="corrupt trainer state"):
        ckpt.load_trainer_state(tmp_path / "c")


def test_mismatched_model_is_refused(tmp_path):
    ckpt.write_checkpoint(tmp_path / "c", net(0), {"step": 1})
    with pytest.raises(CheckpointError, match="does not match"):
        ckpt.load_weights(nn.Sequential(nn.Linear(4, 3)), tmp_path / "c")


def test_average_is_the_elementwise_mean(tmp_path):
    nets = [net(s) for s in (0, 1, 2)]
    dirs = [ckpt.write_checkpoint(ckpt.step_dir(tmp_path, i), n, {"step": i})
            for i, n in enumerate(nets)]
    out = ckpt.average_checkpoints(dirs, tmp_path / "averaged")
    avg = net(9)
    ckpt.load_weights(avg, out)
    for i, p in enumerate(avg.parameters()):
        expected = sum(list(n.parameters())[i] for n in nets) / 3
        torch.testing.assert_close(p, expected)


def test_resolve_prefers_averaged_then_best_then_latest(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ckpt.resolve_checkpoint(tmp_path)
    ckpt.write_checkpoint(ckpt.step_dir(tmp_path, 5), net(0), {"step": 5})
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_00000005"
    ckpt.write_checkpoint(tmp_path / "best", net(0), {"step": 5})
    assert ckpt.resolve_checkpoint(tmp_path).name == "best"
    assert ckpt.resolve_checkpoint(tmp_path, "latest").name == "step_00000005"
    with pytest.raises(CheckpointError):
        ckpt.resolve_checkpoint(tmp_path, "averaged")
