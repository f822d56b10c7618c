"""../shared/seeds/004 (migrating from GPUs) as scripts for ``python -m xlatorch.compat``: see
compat_snippets.py for the conventions (``PRELUDE``, lines marked ``# (test)``)."""

from compat_snippets import PRELUDE

# ../shared/seeds/004: the guide's MNISTNet, from its torch_xla.launch example.
MNIST_NET = """
class MNISTNet(nn.Module):
    def __init__(self):
        super(MNISTNet, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=1, padding=1)
        self.fc1 = nn.Linear(7*7*64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 7*7*64)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)
"""

# ../shared/seeds/004: migrating from GPUs (single device).
SEED_004 = (
    PRELUDE
    + MNIST_NET
    + """
learning_rate = lr  # (test)
model = MNIST(); data, target = next(iter(train_loader))  # (test) the guide's "GPU code" made these

import torch_xla.core.xla_model as xm

# Acquire the XLA device (e.g., a TPU core)
device = xm.xla_device()

# Move your model and data to the XLA device
model.to(device)
data = data.to(device)
record("model_device", str(next(model.parameters()).device)); record("data_device", str(data.device))  # (test)

import torch_xla  # (test) the guide's lazy-execution snippet assumes a step in progress:
loss_fn = nn.NLLLoss(); optimizer = optim.SGD(model.parameters(), lr=lr)  # (test)
optimizer.zero_grad(); loss = loss_fn(model(data), target.to(device))  # (test)
# ...
loss.backward()
optimizer.step() # Operations are added to a graph, not executed yet

# Explicitly tell XLA to compile and run the graph for this step
torch_xla.sync()

# To print a tensor's value, ensure the graph producing it has executed.
# Often, printing is done less frequently or via asynchronous callbacks.
# If printing immediately after sync, the value will be available:
print(loss.item())
# For better performance, consider printing/logging less frequently or moving
# the tensor to CPU first if needed outside the main loop:
print(loss.cpu().item()) # This will also trigger a sync if not done already
record("step_initial", _INITIAL[-1]); record("step_loss", loss.item()); record("step_final", cpu_state(model))  # (test)

torch.manual_seed(1)  # (test) the test rebuilds MNISTNet() from this seed
device = xm.xla_device()
model = MNISTNet().to(device)
train_loader = torch.utils.data.DataLoader(synthetic_mnist(16), batch_size=8) # (test) for DataLoader(...)
optimizer = optim.SGD(model.parameters(), lr=learning_rate)
loss_fn = nn.NLLLoss()

for data, target in train_loader:
    optimizer.zero_grad()
    data, target = data.to(device), target.to(device)
    output = model(data)
    loss = loss_fn(output, target)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
record("recap_final", cpu_state(model))  # (test)

def amp_import():  # (test) the rest of the guide's AMP snippet is not Python (xm.optimizer_step.(optimizer))
  from torch_xla.amp import syncfree
  record("syncfree", syncfree.__name__)  # (test)
record("amp_error", error_of(amp_import))  # (test)

# Saving
xm.save(model.state_dict(), "model_xla.pt", master_only=True) # master_only recommended
if xm.is_master_ordinal():
   cpu_state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
   torch.save(cpu_state_dict, "model_cpu.pt")

# Loading
model.load_state_dict(torch.load("model_cpu.pt"))
model.to(device) # Then move to XLA device
record("xm_saved", torch.load("model_xla.pt")); record("cpu_saved", torch.load("model_cpu.pt"))  # (test)
record("reloaded", cpu_state(model)); record("reloaded_device", str(next(model.parameters()).device))  # (test)
torch.save(OUT, sys.argv[1])  # (test)
"""
)

# ../shared/seeds/004: mnist_xla_distributed.py (run with CPU_NUM_DEVICES=2), on synthetic data.
SEED_004_LAUNCH = (
    PRELUDE
    + """
# mnist_xla_distributed.py

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
# from torchvision import datasets, transforms  (test) no torchvision: synthetic_mnist below

# PyTorch/XLA specific imports

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl # For MpDeviceLoader
import torch_xla.runtime as xr # For runtime utilities like world_size

# Re-define MNISTNet here for completeness (same as before)
"""
    + MNIST_NET
    + """
# This function will be executed by each XLA process

def _mp_mnist_fn(index, args):
    # `index` is the global ordinal of the current process (0 to N-1)
    # `args` are the arguments passed from torch_xla.launch

    torch.manual_seed(args.seed) # Ensure consistent model initialization if needed

    # 1. Acquire the XLA device for THIS process.
    device = xm.xla_device()

    # 2. Create the model and move it to the process-specific XLA device
    model = MNISTNet().to(device)

    # 3. Create the optimizer
    optimizer = optim.SGD(model.parameters(), lr=args.learning_rate, momentum=args.momentum)

    loss_fn = nn.NLLLoss()

    # 4. Wrap the PyTorch DataLoader with MpDeviceLoader
    #    This handles distributing data shards to each device.
    #    The underlying train_dataset is shared, MpDeviceLoader handles per-device dispatch.
    mp_train_loader = pl.MpDeviceLoader(args.train_loader, device)

    print(f"Process {index} (Global Ordinal {xr.global_ordinal()}): Starting training on {xm.xla_device_hw(device)}...")

    for epoch in range(1, args.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(mp_train_loader):
            # Data and target are already on the correct 'device' from MpDeviceLoader
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()

            # 5. Use xm.optimizer_step to handle gradient reduction and optimizer update
            #    This also includes the necessary synchronization (like torch_xla.sync()).
            xm.optimizer_step(optimizer)

            if batch_idx % args.log_interval == 0:
                # Print only on the master ordinal to avoid spamming logs
                if xm.is_master_ordinal(local=False): # global_master=False for per-host master
                    print(f'Process {index} - Train Epoch: {epoch} '
                          f'[{batch_idx * len(data) * xr.world_size()}/{len(args.train_loader.dataset)} '
                          f'({100. * batch_idx / len(args.train_loader):.0f}%)]\\tLoss: {loss.item():.6f}')

        # It's good practice to wait for all processes at epoch boundaries if doing validation
        # xm.rendezvous('epoch_end') # Example, might not be strictly needed here

    if xm.is_master_ordinal(local=False):
        print(f"Process {index}: Training finished!")
        # Optionally save the model (master_only is True by default in xm.save)
        # xm.save(model.state_dict(), "mnist_xla_distributed.pt")
    torch.save({"index": index, "pid": os.getpid(), "final": cpu_state(model)}, f"{sys.argv[1]}.{index}")  # (test)

# Define training configurations
class Args:
    epochs = 2
    learning_rate = 0.01
    momentum = 0.5
    batch_size = 64 # This will be the per-device batch size
    seed = 42
    log_interval = 50 # Log every 50 batches

if __name__ == '__main__':

    args = Args()

    # Create the shared DataLoader (not wrapped by MpDeviceLoader here yet)
    train_dataset = synthetic_mnist(256)  # (test) for datasets.MNIST('./data', train=True, download=True, ...)

    # Note: No DistributedSampler needed here if using MpDeviceLoader,
    # as MpDeviceLoader handles distributing distinct shards.
    args.train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=True, # Shuffle should be True for training
        num_workers=1 # Can be > 0
    )

    # 6. Start distributed training on all available XLA devices with torch_xla.launch
    # Ensure PJRT_DEVICE is set in your environment (e.g., export PJRT_DEVICE=TPU)
    print("Launching distributed MNIST training...")
    torch_xla.launch(_mp_mnist_fn, args=(args,))
"""
)
