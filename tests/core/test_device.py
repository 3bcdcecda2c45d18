"""Which device a ``device=`` value names (:func:`pick_device`), on this CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from dynaseq.core.distributed import pick_device
from dynaseq.core.errors import ConfigError

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine")


@pytest.mark.parametrize("name", ["cpu", "CPU", "cpu:0", torch.device("cpu"), "Auto", None])
@needs_no_cuda
def test_every_spelling_of_the_cpu_and_auto_is_the_cpu(name):
    assert pick_device(name) == torch.device("cpu")


@pytest.mark.parametrize("name, message", [
    ("mps", "device must be auto, cpu, cuda or cuda:N, got 'mps'"),
    ("gpu", "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("", "device must be auto, cpu, cuda or cuda:N, got ''"),
    (3, "device must be auto, cpu, cuda or cuda:N, got 3"),
])
def test_other_devices_are_refused_by_name(name, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        pick_device(name)


@needs_no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_without_cuda_names_what_was_asked(name):
    with pytest.raises(ConfigError, match="but no CUDA device is available"):
        pick_device(name, what="train.device")
    with pytest.raises(ConfigError, match=f"^train.device={name} but"):
        pick_device(name, what="train.device")


@needs_no_cuda
def test_a_run_loads_on_a_torch_device(trained_run):
    import dynaseq

    t = dynaseq.load(trained_run, device=torch.device("cpu"))
    assert t.device == torch.device("cpu")
    assert t.translate(["kalo sum 3 4 end"]) == dynaseq.load(trained_run).translate(
        ["kalo sum 3 4 end"])
