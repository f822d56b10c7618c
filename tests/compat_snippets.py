"""The seeds' code snippets (``../shared/seeds/``) as scripts for ``python -m xlatorch.compat``.

Each script is a guide's snippets, in the guide's order and with the guide's imports,
after ``PRELUDE`` (what the guides leave to the reader: an ``MNIST`` model, a synthetic
``train_loader``, ``lr``, ``momentum``). Lines marked ``# (test)`` are not the guide's:
they record what the snippets computed into ``sys.argv[1]`` (a ``torch.save`` file read by
tests/test_compat.py, which recomputes it with eager PyTorch on CPU), or catch an error a
guide announces. ``...`` placeholders of a guide are filled with the prelude's names.
"""

PRELUDE = """
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

torch.manual_seed(0)
lr, momentum, num_epochs = 0.05, 0.5, 1
_INITIAL = []  # each model's initial weights, on CPU: the test's eager reference starts there


class MNIST(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.fc1 = nn.Linear(4 * 12 * 12, 10)
        _INITIAL.append({k: v.detach().clone() for k, v in self.state_dict().items()})

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        return F.log_softmax(self.fc1(x.flatten(1)), dim=1)


def synthetic_mnist(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 1, 28, 28, generator=g)
    return torch.utils.data.TensorDataset(images, torch.randint(0, 10, (n,), generator=g))


train_loader = torch.utils.data.DataLoader(synthetic_mnist(32), batch_size=8)
OUT = {}


def record(name, value):
    from torch.utils._pytree import tree_map

    OUT[name] = tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)


def cpu_state(model):
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
"""

# ../shared/seeds/000: torch_xla 1.x, "PyTorch on TPUs".
SEED_000 = (
    PRELUDE
    + """
import torch
import torch_xla
import torch_xla.core.xla_model as xm

t = torch.randn(2, 2, device=xm.xla_device())
print(t.device)
print(t)
record("device", str(t.device))  # (test)

t0 = torch.randn(2, 2, device=xm.xla_device())
t1 = torch.randn(2, 2, device=xm.xla_device())
print(t0 + t1)

print(t0.mm(t1))
record("t0", t0); record("t1", t1); record("add", t0 + t1); record("mm", t0.mm(t1))  # (test)

l_in = torch.randn(10, device=xm.xla_device())
linear = torch.nn.Linear(10, 20).to(xm.xla_device())
l_out = linear(l_in)
print(l_out)
record("l_in", l_in); record("l_out", l_out); record("linear", cpu_state(linear))  # (test)

def cpu_linear():  # (test)
  l_in = torch.randn(10, device=xm.xla_device())
  linear = torch.nn.Linear(10, 20).cpu()
  l_out = linear(l_in)
  print(l_out)
  # Input tensor is not an XLA tensor: torch.FloatTensor
record("cpu_linear_error", error_of(cpu_linear))  # (test)

def getting_started():  # (test) the guide never moves MNIST() to the device
  device = xm.xla_device()
  model = MNIST()
  loss_fn = nn.NLLLoss()
  optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)

  model.train()
  for data, target in train_loader:
    optimizer.zero_grad()
    data = data.to(device)
    target = target.to(device)
    output = model(data)
    loss = loss_fn(output, target)
    loss.backward()
    xm.optimizer_step(optimizer, barrier=True)
record("getting_started_error", error_of(getting_started))  # (test)

import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp

def _mp_fn(index):
  device = xm.xla_device()
  para_loader = pl.ParallelLoader(train_loader, [device])

  model = MNIST()
  loss_fn = nn.NLLLoss()
  optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)

  model.train()
  for data, target in para_loader.per_device_loader(device):
    optimizer.zero_grad()
    output = model(data)
    loss = loss_fn(output, target)
    loss.backward()
    xm.optimizer_step(optimizer)

if __name__ == '__main__':
  record("mp_error", error_of(lambda: xmp.spawn(_mp_fn, args=())))  # (test) one process: runs here

import torch_xla.distributed.data_parallel as dp

devices = xm.get_xla_supported_devices()
model_parallel = dp.DataParallel(MNIST, device_ids=devices)

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

for epoch in range(1, num_epochs + 1):
  model_parallel(train_loop_fn, train_loader)
record("dp_devices", devices); record("dp_initial", _INITIAL[-1])  # (test)
record("dp_final", cpu_state(model_parallel.models[0]))  # (test)

t0 = torch.randn(2, 2, device=xm.xla_device())
t1 = torch.randn(2, 2, device=xm.xla_device())

tensors = (t0, t1)

torch.save(tensors, 'tensors.pt')

tensors = torch.load('tensors.pt')

print(tensors)
record("saved", (t0, t1)); record("loaded", tensors); record("loaded_device", str(tensors[0].device))  # (test)

t = torch.randn(2, 2, device=xm.xla_device())
t_view = t[0:2]

tensors = (t, t_view)

torch.save(tensors, 'tensors.pt')
# RuntimeError: Tensor ID 2 is sharing a view with tensor ID 1
t2, t2_view = torch.load('tensors.pt'); t2_view.add_(1)  # (test) xlatorch saves views
record("view_saved", t); record("view_loaded", t2)  # (test)
torch.save(OUT, sys.argv[1])  # (test)
"""
)

# ../shared/seeds/001: torch_xla's API_GUIDE (single device; save and load).
SEED_001 = (
    PRELUDE
    + """
import torch_xla.core.xla_model as xm

device = xm.xla_device()
model = MNIST().train().to(device)
loss_fn = nn.NLLLoss()
optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)

for data, target in train_loader:
  optimizer.zero_grad()
  data = data.to(device)
  target = target.to(device)
  output = model(data)
  loss = loss_fn(output, target)
  loss.backward()

  optimizer.step()
  xm.mark_step()
record("initial", _INITIAL[-1]); record("final", cpu_state(model))  # (test)

import torch
import torch_xla
import torch_xla.core.xla_model as xm

device = xm.xla_device()

t0 = torch.randn(2, 2, device=device)
t1 = torch.randn(2, 2, device=device)

tensors = (t0.cpu(), t1.cpu())

torch.save(tensors, 'tensors.pt')

tensors = torch.load('tensors.pt')

t0 = tensors[0].to(device)
t1 = tensors[1].to(device)
record("saved", tensors); record("loaded", (t0, t1)); record("loaded_device", str(t0.device))  # (test)

import torch
import torch_xla
import torch_xla.core.xla_model as xm

path = 'model.pt'  # (test)
xm.save(model.state_dict(), path)
record("xm_saved", torch.load(path))  # (test) CPU tensors, loadable without xlatorch

import torch_xla.utils.serialization as xser

xser.save(model.state_dict(), path)

import torch_xla.utils.serialization as xser

state_dict = xser.load(path)
model.load_state_dict(state_dict)
record("xser_loaded", cpu_state(model))  # (test)
torch.save(OUT, sys.argv[1])  # (test)
"""
)

# ../shared/seeds/001: the multiprocessing snippet (run with CPU_NUM_DEVICES=2: two workers).
SEED_001_MP = (
    PRELUDE
    + """
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp

def _mp_fn(index):
  device = xm.xla_device()
  mp_device_loader = pl.MpDeviceLoader(train_loader, device)

  model = MNIST().train().to(device)
  loss_fn = nn.NLLLoss()
  optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)

  for data, target in mp_device_loader:
    optimizer.zero_grad()
    output = model(data)
    loss = loss_fn(output, target)
    loss.backward()
    xm.optimizer_step(optimizer)
  torch.save({"index": index, "pid": os.getpid(), "main": __name__, "initial": _INITIAL[-1],  # (test)
              "final": cpu_state(model)}, f"{sys.argv[1]}.{index}")  # (test)

if __name__ == '__main__':
  xmp.spawn(_mp_fn, args=())
"""
)

# ../shared/seeds/002: lazy_tensor_core's guide.
SEED_002 = (
    PRELUDE
    + """
import torch
import lazy_tensor_core
import lazy_tensor_core.core.lazy_model as ltm

t = torch.randn(2, 2, device=ltm.lazy_device())
print(t.device)
print(t)
record("device", str(t.device))  # (test)

t0 = torch.randn(2, 2, device=ltm.lazy_device())
t1 = torch.randn(2, 2, device=ltm.lazy_device())
print(t0 + t1)

print(t0.mm(t1))
record("t0", t0); record("t1", t1); record("add", t0 + t1); record("mm", t0.mm(t1))  # (test)

l_in = torch.randn(10, device=ltm.lazy_device())
linear = torch.nn.Linear(10, 20).to(ltm.lazy_device())
l_out = linear(l_in)
print(l_out)
record("l_in", l_in); record("l_out", l_out); record("linear", cpu_state(linear))  # (test)

def cpu_linear():  # (test)
  l_in = torch.randn(10, device=ltm.lazy_device())
  linear = torch.nn.Linear(10, 20)
  l_out = linear(l_in)
  print(l_out)
  # Input tensor is not a lazy tensor: torch.FloatTensor
record("cpu_linear_error", error_of(cpu_linear))  # (test)

import lazy_tensor_core.core.lazy_model as ltm

device = ltm.lazy_device()
model = MNIST().train().to(device)
loss_fn = nn.NLLLoss()
optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)

for data, target in train_loader:
  optimizer.zero_grad()
  data = data.to(device)
  target = target.to(device)
  output = model(data)
  loss = loss_fn(output, target)
  loss.backward()

  optimizer.step()
  ltm.mark_step()
record("initial", _INITIAL[-1]); record("final", cpu_state(model))  # (test)

import torch
import lazy_tensor_core
import lazy_tensor_core.core.lazy_model as ltm

device = ltm.lazy_device()

t0 = torch.randn(2, 2, device=device)
t1 = torch.randn(2, 2, device=device)

tensors = (t0.cpu(), t1.cpu())

torch.save(tensors, 'tensors.pt')

tensors = torch.load('tensors.pt')

t0 = tensors[0].to(device)
t1 = tensors[1].to(device)
record("saved", tensors); record("loaded", (t0, t1)); record("loaded_device", str(t0.device))  # (test)

import torch
import lazy_tensor_core
import lazy_tensor_core.core.lazy_model as ltm

path = 'model.pt'  # (test)
ltm.save(model.state_dict(), path)
record("ltm_saved", torch.load(path))  # (test)

import lazy_tensor_core.utils.serialization as xser

xser.save(model.state_dict(), path)

import lazy_tensor_core.utils.serialization as xser

state_dict = xser.load(path)
model.load_state_dict(state_dict)
record("xser_loaded", cpu_state(model))  # (test)
import lazy_tensor_core.debug.metrics as metrics  # (test) the name the LTC examples use
record("mark_steps", metrics.counter_value("MarkStep"))  # (test)
torch.save(OUT, sys.argv[1])  # (test)
"""
)

# ../shared/seeds/003: torch_xla 0.1's performance guide (torch_xla_py).
SEED_003 = (
    PRELUDE
    + """
import torch
import torch_xla
import torch_xla_py.xla_model as xm

x = torch.randn(4, 2, device=xm.xla_device())
print(x.device)
print(x)
record("device", str(x.device)); record("x_sum", x.sum()); record("x", x)  # (test)

import torch_xla_py.xla_model as xm
import torch_xla_py.data_parallel as dp

devices = xm.get_xla_supported_devices()
model_parallel = dp.DataParallel(MNIST, device_ids=devices)

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

for epoch in range(1, num_epochs + 1):
  model_parallel(train_loop_fn, train_loader)
record("initial", _INITIAL[-1]); record("final", cpu_state(model_parallel.models[0]))  # (test)

def clip_grad_norm(parameters, max_norm, norm_type=2.0):  # (test) the guide's fragment, in the
    if not parameters:  # (test) function it comes from (torch.nn.utils.clip_grad_norm_)
      return  # (test)
    else:
      device = parameters[0].device
      total_norm = torch.zeros([], device=device if parameters else None)
      for p in parameters:
        param_norm = p.grad.data.norm(norm_type) ** norm_type
        total_norm.add_(param_norm)
      total_norm = (total_norm ** (1. / norm_type))
    clip_coef = torch.tensor(max_norm, device=device) / (total_norm + 1e-6)
    for p in parameters:
      p.grad.data.mul_(torch.where(clip_coef < 1, clip_coef, torch.tensor(1., device=device)))
params = list(model_parallel.models[0].parameters())  # (test)
record("grads", [p.grad for p in params]); clip_grad_norm(params, 0.01)  # (test)
record("clipped", [p.grad for p in params])  # (test)

print(torch_xla._XLAC._xla_metrics_report())
record("report", torch_xla._XLAC._xla_metrics_report())  # (test)
torch.save(OUT, sys.argv[1])  # (test)
"""
)
