import shutil

import numpy as np
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


def _tiny_checkpoint(tmp_path):
    import torch
    from torch import nn

    from dynaseq.core.checkpoint import write_checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    write_checkpoint(tmp_path / "ck", model, {"step": 1}, {"x": torch.zeros(2)})
    return model, tmp_path / "ck"


def test_damaged_weights_are_refused_not_loaded(tmp_path):
    """A flipped byte inside the weights (the header still parses), NaN weights and weights
    of another dtype are refused; the trainer state is checksummed too."""
    import pytest
    import torch
    from safetensors.torch import save_file

    from dynaseq.core.checkpoint import load_trainer_state, load_weights, read_meta
    from dynaseq.core.errors import CheckpointError

    model, ck = _tiny_checkpoint(tmp_path)
    assert set(read_meta(ck)["sha256"]) == {"model.safetensors", "trainer.pt"}
    load_weights(model, ck)
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes
    (ck / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        load_weights(model, ck)
    (ck / "trainer.pt").write_bytes((ck / "trainer.pt").read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        load_trainer_state(ck)
    (ck / "meta.json").unlink()  # an old checkpoint without checksums: the tensors are checked
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight"][0, 0] = float("nan")
    save_file(state, str(ck / "model.safetensors"))
    with pytest.raises(CheckpointError, match="0.weight holds non-finite"):
        load_weights(model, ck)
    state = {k: v.double() for k, v in model.state_dict().items()}
    save_file(state, str(ck / "model.safetensors"))
    with pytest.raises(CheckpointError, match="is torch.float64, the model expects torch.float32"):
        load_weights(model, ck)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # nothing was loaded


def test_a_kill_between_the_renames_of_best_is_recovered(tmp_path):
    """best/ is replaced by two renames (best -> .old-best, .tmp-best -> best); a kill in
    between leaves neither best/ nor a pointer. The next load brings back the complete new
    one, or else the old one."""
    run = tmp_path / "run"
    ckpt.write_checkpoint(run / "best", net(0), {"step": 1})
    ckpt.write_checkpoint(run / ".tmp-best", net(1), {"step": 2})  # complete, not yet renamed
    (run / "best").rename(run / ".old-best")
    assert ckpt.read_meta(ckpt.resolve_checkpoint(run, "best"))["step"] == 2
    assert sorted(p.name for p in run.iterdir()) == [".old-best", "best"]
    # a new best that was not complete (no meta.json yet): the old one comes back
    (run / "best").rename(run / ".old-best2")
    shutil.rmtree(run / ".old-best")
    (run / ".old-best2").rename(run / ".old-best")
    (run / ".tmp-best").mkdir()
    (run / ".tmp-best" / ckpt.WEIGHTS).write_bytes(b"partial")
    assert ckpt.read_meta(ckpt.resolve_checkpoint(run, "auto"))["step"] == 2


def test_a_stray_step_directory_is_not_a_checkpoint(tmp_path):
    ckpt.write_checkpoint(ckpt.step_dir(tmp_path, 5), net(0), {"step": 5})
    (tmp_path / "checkpoints" / "step_abc").mkdir()
    (tmp_path / "checkpoints" / "step_abc" / ckpt.META).write_text("{}")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000005"]


def test_a_shape_mismatch_names_the_first_tensor_and_both_shapes(tmp_path):
    from torch import nn

    from dynaseq.core.checkpoint import load_weights, write_checkpoint
    from dynaseq.core.errors import CheckpointError

    write_checkpoint(tmp_path / "c", nn.Sequential(nn.Linear(4, 3)), {"step": 1})
    with pytest.raises(CheckpointError, match=r"0\.bias has shape \(3,\), the model "
                                              r"expects \(5,\)"):
        load_weights(nn.Sequential(nn.Linear(4, 5)), tmp_path / "c")


def test_a_checkpoint_is_named_by_its_step_or_a_path_inside_the_run(trained_run, monkeypatch,
                                                                     tmp_path):
    import dynaseq
    from dynaseq.core.checkpoint import list_checkpoints, resolve_checkpoint

    first, last = list_checkpoints(trained_run)
    assert resolve_checkpoint(trained_run, 10) == resolve_checkpoint(trained_run, "10") == first
    assert resolve_checkpoint(trained_run, 20) == resolve_checkpoint(
        trained_run, np.int64(20)) == last  # numpy's integers too
    monkeypatch.chdir(tmp_path)  # a path inside the run, from elsewhere
    assert resolve_checkpoint(trained_run, f"checkpoints/{first.name}") == trained_run / (
        f"checkpoints/{first.name}")
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 15 in .* \(steps: 10, "
                                              r"20\)"):
        resolve_checkpoint(trained_run, 15)
    with pytest.raises(CheckpointError, match="a checkpoint is auto, best, latest, averaged, "
                                              "a step or a path, got True"):
        resolve_checkpoint(trained_run, True)
    line = ["kalo sum 3 4 end"]
    assert (dynaseq.load(trained_run, checkpoint=20).translate(line)
            == dynaseq.load(trained_run, checkpoint="latest").translate(line))


def test_an_atomic_write_gets_the_mode_a_plain_write_gets(tmp_path):
    """0666 less the umask (it was mkstemp's 0600: unreadable to a server of another user),
    and an existing file keeps its own."""
    import os
    import stat

    from dynaseq.core.files import atomic_write

    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "new.txt", "x")
        assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o644
        (tmp_path / "kept.txt").write_text("old")
        os.chmod(tmp_path / "kept.txt", 0o640)
        atomic_write(tmp_path / "kept.txt", "new")
        assert stat.S_IMODE((tmp_path / "kept.txt").stat().st_mode) == 0o640
        assert (tmp_path / "kept.txt").read_text() == "new"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "new.txt"]
    finally:
        os.umask(old)


def test_an_atomic_write_to_a_device_or_a_pipe_writes_into_it(tmp_path):
    """``-o /dev/null`` renamed a regular file over the device (as root, every later write
    to /dev/null went into that file): a path that is not a regular file is written to."""
    import os
    import threading

    from dynaseq.core.files import atomic_write

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    atomic_write(fifo, "through the pipe\n")
    reader.join(10)
    assert got == [b"through the pipe\n"]
    assert fifo.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_latest_read_while_training_deletes_it_or_rewrites_it_is_read_again(trained_run,
                                                                             tmp_path):
    """A training run's ``keep_last`` deletes the checkpoint being read (its weights gone,
    its folder not yet): ``latest`` takes the next newest, not "corrupt checkpoint"; a
    checkpoint rewritten while read (:class:`CheckpointChanged`) is read again."""
    from dynaseq.core.checkpoint import CheckpointChanged, list_checkpoints, load_resolved

    run = shutil.copytree(trained_run, tmp_path / "run")
    first, last = list_checkpoints(run)
    read = []

    def load(path):
        read.append(path)
        if path == last and len(read) == 1:  # deleted mid-read: the weights first
            (path / "model.safetensors").unlink()
            raise CheckpointError(f"corrupt checkpoint {path}: No such file or directory")
        return path

    assert load_resolved(run, "latest", load) == first and read == [last, first]
    assert list_checkpoints(run) == [first]  # no weights: not a complete checkpoint
    tries = []

    def rewritten(path):
        tries.append(path)
        if len(tries) == 1:
            raise CheckpointChanged(f"{path} was rewritten while it was read")
        return path

    assert load_resolved(run, "best", rewritten) == run / "best" and len(tries) == 2


def test_a_checkpoint_rewritten_while_loaded_is_loaded_again(trained_run, monkeypatch):
    """The weights' digest is read before and after the model is loaded; when they differ
    (``best/`` replaced meanwhile) the load starts again, and the predictor keeps the digest
    of the weights it holds (its calibrations are tied to it)."""
    import dynaseq
    from dynaseq.core.checkpoint import weights_digest
    from dynaseq.tasks import loading

    digests = iter(["old", "new"])
    monkeypatch.setattr(loading, "weights_digest",
                        lambda path: next(digests, None) or weights_digest(path))
    t = dynaseq.load(trained_run, checkpoint="best")
    assert t.weights_sha256 == weights_digest(trained_run / "best")
    assert next(digests, "done") == "done"  # the first, mismatched pair was used up


def test_a_load_that_fails_while_the_checkpoint_is_swapped_is_read_again(trained_run,
                                                                         monkeypatch):
    """``best/`` replaced mid-read can fail the read itself (the old meta, the new weights):
    when the digest has moved since the read began, it is read again, not "corrupt"."""
    import dynaseq
    from dynaseq.core.checkpoint import weights_digest
    from dynaseq.tasks import loading
    from dynaseq.tasks.translation import predictor

    real = predictor.load_weights
    calls, digests = [], iter(["old", "new"])

    def flaky(model, path):
        calls.append(path)
        if len(calls) == 1:
            raise CheckpointError(f"corrupt checkpoint {path}: its SHA-256 does not match")
        real(model, path)

    monkeypatch.setattr(predictor, "load_weights", flaky)  # a translation run's weights
    monkeypatch.setattr(loading, "weights_digest",
                        lambda path: next(digests, None) or weights_digest(path))
    t = dynaseq.load(trained_run, checkpoint="best")
    assert len(calls) == 2 and t.weights_sha256 == weights_digest(trained_run / "best")
    monkeypatch.setattr(loading, "weights_digest", weights_digest)  # the same digest: real
    calls.clear()
    with pytest.raises(CheckpointError, match="does not match"):
        dynaseq.load(trained_run, checkpoint="best")
