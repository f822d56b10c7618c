"""torch_xla.utils.utils helpers and the env-var names (issue 16 §2)."""

import pytest
import torch

import xlatorch.core.xla_env_vars as xenv
import xlatorch.distributed.parallel_loader as pl
import xlatorch.utils.utils as xu


def test_getenv_as(monkeypatch):
    monkeypatch.setenv("XT_INT", "12")
    monkeypatch.setenv("XT_BOOL", "off")
    monkeypatch.setenv("XT_BAD", "twelve")
    assert xu.getenv_as("XT_INT", int) == 12 and xu.getenv_as("XT_BOOL", bool, True) is False
    assert xu.getenv_as("XT_UNSET", float, 1.5) == 1.5
    with pytest.raises(ValueError, match="XT_BAD"):
        xu.getenv_as("XT_BAD", int)
    with pytest.raises(ValueError, match="not a boolean"):
        xu.getenv_as("XT_BAD", bool)


def test_as_list_and_sample_generator():
    assert xu.as_list((1, 2)) == [1, 2] and xu.as_list([3]) == [3] and xu.as_list(4) == [4]
    data = (torch.zeros(2, 3), torch.ones(2, dtype=torch.long))
    gen = xu.SampleGenerator(data=data, sample_count=3)
    assert len(gen) == 3 and all(b is data for b in gen)
    # As the guides use it: in place of a DataLoader, through the device loader.
    batches = list(pl.MpDeviceLoader(gen, torch.device("xla")))
    assert len(batches) == 3 and batches[0][0].device.type == "xla"
    torch.testing.assert_close(batches[2][1].cpu(), data[1])


class _Pair(xu.DataWrapper):
    def __init__(self, a, b, tag):
        self.a, self.b, self.tag = a, b, tag

    def get_tensors(self):
        return [self.a, self.b]

    def from_tensors(self, tensors):
        return _Pair(*tensors, self.tag)


def test_data_wrapper_batches_reach_the_device():
    batch = _Pair(torch.arange(3.0), torch.arange(2), "x")
    (got,) = list(pl.MpDeviceLoader([batch], torch.device("xla")))
    assert isinstance(got, _Pair) and got.tag == "x" and got.a.device.type == "xla"
    torch.testing.assert_close(got.a.cpu(), batch.a)
    with pytest.raises(NotImplementedError):
        xu.DataWrapper().get_tensors()


def test_env_var_names():
    assert xenv.PJRT_DEVICE == "PJRT_DEVICE" and xenv.XLA_USE_BF16 == "XLA_USE_BF16"
