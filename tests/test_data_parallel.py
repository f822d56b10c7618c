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

from tests import warm

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


def _run_on_two_devices(script: str, timeout: float = 300) -> dict:
    """Run ``script`` in a process with two local devices; the JSON of its last line. A script
    that hangs (replicas waiting for each other) fails the test after ``timeout`` seconds."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=ROOT)
    try:
        r = warm.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                     timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"no result after {timeout:g}s (a hang): {(e.stderr or b'')[-3000:]!r}") from None
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


class AutocastNet(nn.Module):
    """A replica whose forward casts: autocast's bfloat16 linear, cast back to float32."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 3)

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.l(x).float()


_AUTOCAST = r"""
import json, torch, torch.nn as nn, torch.optim as optim
import xlatorch.core.xla_model as xm
import xlatorch.distributed.data_parallel as dp
import xlatorch.debug.metrics as met
from tests.test_data_parallel import AutocastNet, dataset

train_loader = torch.utils.data.DataLoader(dataset(), batch_size=6)
torch.manual_seed(0)
model_parallel = dp.DataParallel(AutocastNet, device_ids=xm.get_xla_supported_devices())

def train_loop_fn(model, loader, device, context):
  optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  for step, (data, target) in loader:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(data), target)
    loss.backward()
    xm.optimizer_step(optimizer)
    if step == 0:  # the gradients averaged over the replicas
      grads = [p.grad.cpu().tolist() for p in model.parameters()]
  return xm.get_ordinal(), grads

results = model_parallel(train_loop_fn, train_loader)
params = [[p.tolist() for p in m.cpu().parameters()] for m in model_parallel.models]
print(json.dumps(dict(results=results, params=params, all_reduce=met.counter_value("xla::all_reduce"),
                      fallbacks=met.executed_fallback_ops())))
"""


def test_a_cast_in_the_replicas_forward_trains_as_one_process():
    # The backward pass of a cast (autocast's, .float()) casts the gradient back to the
    # device every tensor reports, xla:0. On autograd's device thread that moved replica 1's
    # gradient to device 0, and replica 0 waited forever for replica 1's all_reduce.
    out = _run_on_two_devices(_AUTOCAST, timeout=120)
    assert [o for o, _ in out["results"]] == [0, 1]
    torch.manual_seed(0)
    ref = AutocastNet()
    opt = optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, (data, target) in enumerate(torch.utils.data.DataLoader(dataset(), batch_size=12)):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(data), target).backward()
        opt.step()
        if step == 0:
            want_grads = [p.grad.clone() for p in ref.parameters()]
    # The weight gradients are bfloat16 sums (8 significant bits; every value here is below
    # 1, so one rounding moves it by at most 2**-9), and the replicas sum 6 rows each where
    # CPU sums 12: they round at different places. Measured: 2**-9 at most.
    tol = dict(rtol=2**-7, atol=2**-8)
    for _, grads in out["results"]:
        for g, want in zip(grads, want_grads):
            torch.testing.assert_close(torch.tensor(g), want, **tol)
    replicas = [[torch.tensor(p) for p in m] for m in out["params"]]
    for a, b, want in zip(*replicas, ref.parameters()):
        assert torch.equal(a, b)  # the replicas stay identical
        torch.testing.assert_close(a, want.detach(), **tol)
    assert out["all_reduce"] == 2 * 4  # per replica, per step
    assert out["fallbacks"] == []


_IN_BACKWARD = r"""
import json, torch, torch.optim as optim
import xlatorch.core.xla_model as xm
import xlatorch.distributed.data_parallel as dp
from tests.test_data_parallel import Net, dataset

train_loader = torch.utils.data.DataLoader(dataset(), batch_size=6)
torch.manual_seed(0)

def loop_fn(model, loader, device, context):
  seen = []
  for _, (data, target) in loader:
    total = xm.all_reduce(xm.REDUCE_SUM, data.sum())  # pending until the hook reads it
    out = model(data)
    out.register_hook(lambda g: seen.append(total.item()))  # a replicated step inside backward
    out.sum().backward()
    xm.optimizer_step(optim.SGD(model.parameters(), lr=0.1))
  return seen

print(json.dumps(dp.DataParallel(Net, device_ids=xm.get_xla_supported_devices())(loop_fn, train_loader)))
"""


def test_a_collective_synced_inside_a_backward_pass():
    # Every replica's backward ran on autograd's one device thread: the first replica's
    # collective blocked it, and the other replicas' backward passes could never reach theirs.
    out = _run_on_two_devices(_IN_BACKWARD, timeout=120)
    data = dataset().tensors[0]
    want = [data[i : i + 12].sum().item() for i in range(0, 48, 12)]
    for seen in out:
        torch.testing.assert_close(torch.tensor(seen), torch.tensor(want))


_UNEVEN = r"""
import json, torch, torch.optim as optim
import xlatorch.core.xla_model as xm
import xlatorch.distributed.data_parallel as dp
from tests.test_data_parallel import Net, dataset

train_loader = torch.utils.data.DataLoader(dataset(), batch_size=6)

def loop_fn(model, loader, device, context):
  for step, (data, target) in loader:
    if step == 1 and xm.get_ordinal() == 1:
      return  # replica 0's second optimizer step waits for replica 1's
    model(data).sum().backward()
    xm.optimizer_step(optim.SGD(model.parameters(), lr=0.1))

try:
  dp.DataParallel(Net, device_ids=xm.get_xla_supported_devices())(loop_fn, train_loader)
  error = None
except RuntimeError as e:
  error = str(e)
print(json.dumps(error))
"""


def test_a_replica_that_skips_a_collective_step_is_an_error_not_a_hang():
    error = _run_on_two_devices(_UNEVEN, timeout=120)
    assert "DataParallel replica 0" in error and "replica 1 returned without joining" in error


_ONE_MORE_VALUE = r"""
import json, torch, torch.nn as nn, torch.optim as optim
import xlatorch.core.xla_model as xm
import xlatorch.distributed.data_parallel as dp
import xlatorch.debug.metrics as met
from tests.test_data_parallel import Net, dataset

train_loader = torch.utils.data.DataLoader(dataset(), batch_size=6)
torch.manual_seed(0)
model_parallel = dp.DataParallel(Net, device_ids=xm.get_xla_supported_devices())
kept = {}

def train_loop_fn(model, loader, device, context):
  optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  for step, (data, target) in loader:
    optimizer.zero_grad()
    loss = nn.NLLLoss()(model(data), target)
    if xm.get_ordinal() == 1:  # only replica 1 keeps a pending value: its step has one more root
      kept[step] = loss * 2
    loss.backward()
    xm.optimizer_step(optimizer)
  return [v.item() for v in kept.values()] if xm.get_ordinal() == 1 else None

results = model_parallel(train_loop_fn, train_loader)
mismatch = met.counter_value("ReplicaMismatch")

def diverging(model, loader, device, context):
  for _, (data, target) in loader:
    s = xm.all_reduce("sum", model(data).sum())
    # a replica's value computed from the collective's result that the other lacks
    extra = s * 3 if xm.get_ordinal() == 1 else None
    xm.mark_step()
    return None
try:
  dp.DataParallel(Net, device_ids=xm.get_xla_supported_devices())(diverging, train_loader)
  error = None
except RuntimeError as e:
  error = str(e)
print(json.dumps(dict(results=results, mismatch=mismatch, error=error,
                      params=[[p.tolist() for p in m.cpu().parameters()] for m in model_parallel.models])))
"""


def test_replicas_whose_steps_hold_different_pending_values_train_as_one_process():
    # One replica keeps a value the other does not (here on purpose; autograd's device thread,
    # shared by the replicas, does it by timing): their programs differ, and running one's
    # program for both handed each the other's outputs. Each now runs its own values alone and
    # the collectives' part as one program.
    out = _run_on_two_devices(_ONE_MORE_VALUE, timeout=120)
    assert out["mismatch"] >= 4  # every step's replicated sync: the two programs differ
    torch.manual_seed(0)
    ref = Net()
    opt = optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want_kept = []
    for data, target in torch.utils.data.DataLoader(dataset(), batch_size=12):
        opt.zero_grad()
        want_kept.append(2 * nn.NLLLoss()(ref(data[6:]), target[6:]).item())  # replica 1's half
        nn.NLLLoss()(ref(data), target).backward()
        opt.step()
    assert out["results"][0] is None
    # Float32 means of 6 rows against 12 on CPU: a few roundings apart, scaled by the step.
    torch.testing.assert_close(torch.tensor(out["results"][1]), torch.tensor(want_kept), rtol=1e-5, atol=1e-6)
    replicas = [[torch.tensor(p) for p in m] for m in out["params"]]
    for a, b, want in zip(*replicas, ref.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)
    # Replicas whose collectives' results feed different computations fail loudly.
    assert "replicas computed different values from their collectives" in out["error"]
