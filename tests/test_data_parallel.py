"""``dp.DataParallel``: the guides' threads-over-local-devices API.

Several local devices need ``XLA_FLAGS=--xla_force_host_platform_device_count`` before
JAX starts, so the guide's snippet runs in a subprocess; this test compares what it
prints with single-process PyTorch on the CPU.
"""

import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.optim as optim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, os
import torch, torch.nn as nn, torch.optim as optim
import xlatorch.core.xla_model as xm
import xlatorch.distributed.data_parallel as dp
import xlatorch.debug.metrics as met
from tests.test_data_parallel import Net, dataset

lr, momentum, num_epochs = 0.1, 0.9, 2
train_loader = torch.utils.data.DataLoader(dataset(), batch_size=6)
torch.manual_seed(0)

devices = xm.get_xla_supported_devices()
model_parallel = dp.DataParallel(Net, device_ids=devices)

def train_loop_fn(model, loader, device, context):
  loss_fn = nn.NLLLoss()
  optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)

  model.train()
  for _, (data, target) in loader:
    optimizer.zero_grad()
    output = model(data)
    loss = loss_fn(output, target)
    loss.backward()
    xm.optimizer_step(optimizer)
  return xm.get_ordinal(), xm.xrt_world_size(), loss.item()

results = []
for epoch in range(1, num_epochs + 1):
  results.append(model_parallel(train_loop_fn, train_loader))

all_reduce = met.counter_value("xla::all_reduce")
cpu = dp.DataParallel(Net, device_ids=[])(lambda m, loader, d, c: (str(d), len(loader)), train_loader)

def broken(model, loader, device, context):
  if xm.get_ordinal() == 1:
    raise ValueError("replica one is broken")
  for _, (data, target) in loader:
    model(data).sum().backward()
    xm.optimizer_step(optim.SGD(model.parameters(), lr=0.1))
try:
  dp.DataParallel(Net, device_ids=devices)(broken, train_loader)
  error = None
except RuntimeError as e:
  error = str(e)

print(json.dumps(dict(
  devices=devices, results=results, cpu=cpu, error=error,
  params=[[p.tolist() for p in m.cpu().parameters()] for m in model_parallel.models],
  all_reduce=all_reduce, fallbacks=met.executed_fallback_ops())))
"""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 3)

    def forward(self, x):
        return torch.log_softmax(self.l2(torch.tanh(self.l1(x))), 1)


def dataset():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g))


def _run_on_two_devices(script: str) -> dict:
    """Run ``script`` in a process with two local devices; the JSON of its last line."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_guide_data_parallel_over_two_local_devices():
    out = _run_on_two_devices(_SCRIPT)
    assert out["devices"] == ["xla:0", "xla:1"]
    for epoch in out["results"]:
        assert [(o, n) for o, n, _ in epoch] == [(0, 2), (1, 2)]  # ordinal and world size per replica
    # Reference: one CPU model on the concatenated batch (two 6-batches per step), a new
    # optimizer per epoch as in the loop function.
    torch.manual_seed(0)
    ref = Net()
    for _ in range(2):
        opt = optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for data, target in torch.utils.data.DataLoader(dataset(), batch_size=12):
            opt.zero_grad()
            nn.NLLLoss()(ref(data), target).backward()
            opt.step()
    replicas = [[torch.tensor(p) for p in m] for m in out["params"]]
    for a, b, want in zip(*replicas, ref.parameters()):
        assert torch.equal(a, b)  # the replicas stay identical
        torch.testing.assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)
    assert out["all_reduce"] == 2 * 2 * 4  # per replica, per step
    assert out["fallbacks"] == []
    assert out["cpu"] == [["cpu", 8]]  # device_ids=[]: one run on native CPU over every batch
    assert "DataParallel replica 1" in out["error"] and "replica one is broken" in out["error"]


_PLACEMENT = r"""
import json, torch
import xlatorch.core.xla_model as xm
a = torch.arange(4.0).to(xm.xla_device(1))
b = (a * 2 + 1).sum()
c = torch.arange(4.0, device="xla") * 3
xm.mark_step()
e = torch.ones(4, device="xla")
e.copy_(a)  # device 1 -> device 0
print(json.dumps(dict(b=b.item(), c=c.tolist(), e=e.tolist(), devs=[t._st.dev for t in (a, b, c, e)],
                      arrays=[str(list(t._st.value.array.devices())[0]) for t in (a, c)])))
"""


def test_explicit_placement_on_a_second_local_device():
    out = _run_on_two_devices(_PLACEMENT)
    assert out["b"] == 16.0 and out["c"] == [0.0, 3.0, 6.0, 9.0] and out["e"] == [0.0, 1.0, 2.0, 3.0]
    assert out["devs"] == [1, 1, 0, 0]
    assert out["arrays"][0] != out["arrays"][1]  # the buffers really live on two devices
