"""Hugging Face ``Trainer`` through the torch_xla front door (issue 29 §3).

``Trainer`` (through ``accelerate``) finds torch_xla and drives it itself: ``xm.set_replication``,
``xm.send_cpu_data_to_device``, ``xm._fetch_gradients`` (gradient clipping), ``MpDeviceLoader``
over a DataLoader that pins memory, ``xm.optimizer_step``, ``xm.mesh_reduce`` for the logged loss.
A tiny GPT-2 trained with ``Trainer``'s defaults under ``python -m xlatorch.compat`` takes the
same steps as the same script on CPU (without the runner, so there torch_xla does not exist).
"""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

from tests import warm

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tolerances import NOISE  # noqa: E402

import xlatorch  # noqa: E402
import xlatorch.core.xla_model as xm  # noqa: E402
from xlatorch.distributed.parallel_loader import MpDeviceLoader  # noqa: E402

# Dropout off: the device's random numbers are not CPU PyTorch's (docs/from-torch-xla.md), and
# a step's loss would differ by whole dropout masks. One batch holds the whole dataset: accelerate
# reseeds the shuffling sampler on XLA (generator seed 42), so the order of the rows differs
# from CPU's, and only the order of the rows within the batch may differ (a rounding-level change).
TRAIN = """
import json, sys, tempfile
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import is_torch_xla_available

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
dataset = [{"input_ids": row, "labels": row} for row in ids]
losses = []


class Recording(Trainer):
    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        losses.append(loss)  # read after training: reading it here would cut the graph
        return loss


with tempfile.TemporaryDirectory() as tmp:
    args = TrainingArguments(output_dir=tmp, max_steps=4, per_device_train_batch_size=8, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Recording(model=model, args=args, train_dataset=dataset)
    trainer.train()
with open(sys.argv[1], "w") as f:
    json.dump({"device": str(args.device), "xla": is_torch_xla_available(),
               "pin_memory": args.dataloader_pin_memory, "losses": [float(x) for x in losses]}, f)
"""


def _start(tmp_path, name, runner):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cmd = [sys.executable, *(["-m", "xlatorch.compat"] if runner else []), str(script), str(tmp_path / name)]
    return warm.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip


def _result(proc, path):
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return json.loads(path.read_text())


def test_trainer_defaults_train_as_on_cpu(tmp_path):
    xla_run = _start(tmp_path, "xla.json", runner=True)
    cpu_run = _start(tmp_path, "cpu.json", runner=False)
    cpu = _result(cpu_run, tmp_path / "cpu.json")
    xla = _result(xla_run, tmp_path / "xla.json")
    assert (cpu["device"], cpu["xla"]) == ("cpu", False)
    assert (xla["device"], xla["xla"], xla["pin_memory"]) == ("xla:0", True, True)
    assert len(xla["losses"]) == len(cpu["losses"]) == 4
    # The first loss is one forward of the same weights on the same rows: rounding only (NOISE).
    # Each later one follows AdamW steps (lr 5e-5, after clipping to norm 1). An element whose
    # gradient is at the noise level may step the other way, but its gradient is that small, so
    # to first order it moves the loss by about lr * NOISE * max|g| each; elements with larger
    # gradients step with relative error NOISE * max|g| / |g|, the same product. Summed over
    # the model's ~40k parameters and three steps, with max|g| <= 1 after clipping, that is
    # 3 * 4e4 * 5e-5 * NOISE = 6 NOISE, on top of the forward's own rounding; 50 NOISE relative
    # leaves room for the second-order terms and still fails on a wrong step (a step is 5e-5 per
    # element, which moves the loss by ~1e-3, over 25 NOISE * 4.5).
    torch.testing.assert_close(xla["losses"], cpu["losses"], rtol=50 * NOISE, atol=0)


# --- the xm functions Trainer and accelerate call -------------------------------------------------


def test_set_replication_sets_this_threads_device():
    xm.set_replication(xm.xla_device(), xm.get_xla_supported_devices())
    xm.set_replication("xla:0", [])
    xm.set_replication(torch.device("xla", 0), None)
    assert torch.ones(2, device="xla").device == torch.device("xla", 0)
    with pytest.raises(ValueError, match="not an xla device"):
        xm.set_replication("cpu", ["xla:0"])
    with pytest.raises(ValueError, match="not one of the replication devices"):
        xm.set_replication("xla:0", ["xla:1", "xla:2"])


def test_send_cpu_data_to_device_rebuilds_containers():
    shared = torch.arange(4.0)
    param = torch.nn.Parameter(torch.ones(2))
    data = {"a": [shared, (shared, 3)], "b": {"c": torch.zeros(2, dtype=torch.int64)}, "p": param, "s": "x"}
    out = xm.send_cpu_data_to_device(data, xm.xla_device())
    assert out["a"][0].device.type == "xla" and out["b"]["c"].device.type == "xla"
    assert out["a"][0] is out["a"][1][0]  # one upload for a tensor reached twice
    assert out["a"][1][1] == 3 and out["s"] == "x" and out["p"] is param  # a Parameter is not plain data
    torch.testing.assert_close(out["a"][0].cpu(), shared)
    torch.testing.assert_close(out["b"]["c"].cpu(), data["b"]["c"])
    (one,) = xm.send_cpu_data_to_device(shared, "xla:0")  # a bare tensor comes back in a list
    torch.testing.assert_close(one.cpu(), shared)


def test_maybe_convert_to_cpu_downloads_device_tensors():
    model = torch.nn.Linear(3, 2).to("xla")
    state = xm._maybe_convert_to_cpu(model.state_dict())
    assert all(t.device.type == "cpu" for t in state.values())
    torch.testing.assert_close(state["weight"], model.weight.detach().cpu())
    assert xm._maybe_convert_to_cpu({"w": model.weight}, convert=False)["w"] is model.weight


def test_fetch_gradients_lists_the_gradients_that_exist():
    a, b, c = (torch.nn.Parameter(torch.ones(2, device="xla")) for _ in range(3))
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1)
    (a.sum() * 2 + c.sum()).backward()
    grads = xm._fetch_gradients(opt)
    assert len(grads) == 2 and b.grad is None
    torch.testing.assert_close([g.cpu() for g in grads], [torch.full((2,), 2.0), torch.ones(2)])


def test_pin_memory_for_the_xla_accelerator():
    assert torch.accelerator.current_accelerator().type == "xla"
    t = torch.arange(6.0).reshape(2, 3).t()
    pinned = t.pin_memory()
    assert pinned.data_ptr() != t.data_ptr() and pinned.is_contiguous() and not t.is_pinned()
    torch.testing.assert_close(pinned, t)
    loader = torch.utils.data.DataLoader(torch.arange(8.0).reshape(4, 2), batch_size=2, pin_memory=True)
    batches = list(MpDeviceLoader(loader, xm.xla_device()))
    torch.testing.assert_close(torch.cat([b.cpu() for b in batches]), torch.arange(8.0).reshape(4, 2))


def test_front_door_distribution_is_xlatorchs_version():
    # transformers looks torch_xla up by its distribution's metadata before importing it.
    front = os.path.join(os.path.dirname(xlatorch.__file__), "compat", "front")
    (dist,) = importlib.metadata.distributions(name="torch_xla", path=[front])
    assert dist.version == xlatorch.__version__


@pytest.mark.parametrize("opt_class,lowered", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_fused_adam_steps_update_every_parameter(opt_class, lowered):
    # Trainer's default optimizer (adamw_torch_fused) is aten::_fused_adamw_, lowered into the
    # step's graph (lowering/optim.py). Fused Adam (aten::_fused_adam_) has no lowering: its CPU
    # fallback must write back each tensor of its Tensor(a!)[] arguments.
    import xlatorch.debug.metrics as met

    torch.manual_seed(0)
    init, x = torch.randn(4, 3), torch.randn(5, 3)
    runs = []
    for device in ("cpu", "xla"):
        w = torch.nn.Parameter(init.clone().to(device))  # CPU: not init itself, which the step writes
        b = torch.nn.Parameter(torch.zeros(4, device=device))
        opt = opt_class([w, b], lr=0.1, fused=True, weight_decay=0.01)
        met.clear_counters()
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.linear(x.to(device), w, b).square().sum().backward()
            opt.step()
        runs.append([w.detach().cpu(), b.detach().cpu(), opt.state[w]["exp_avg_sq"].cpu()])
    name = "aten::_fused_adamw_" if opt_class is torch.optim.AdamW else "aten::_fused_adam_"
    assert (met.counter_value(name) is None) == lowered
    # Two Adam steps of lr 0.1 from the same gradients (up to NOISE): see tolerances.AdaptiveSteps;
    # no gradient element here is near zero, so each step's relative error stays NOISE-sized.
    torch.testing.assert_close(runs[1], runs[0], rtol=100 * NOISE, atol=100 * NOISE)


@pytest.mark.parametrize("amsgrad,maximize,overflow", [(False, False, False), (True, True, True)])
def test_fused_adamw_options_and_grad_scaler_equal_cpu(amsgrad, maximize, overflow):
    # The lowering's amsgrad, maximize, grad_scale and found_inf (GradScaler hands both to fused
    # optimizers; an overflowing step is skipped) against PyTorch's CPU kernel. Tolerance as in
    # the test above: three Adam steps whose gradients have no element near zero.
    import copy

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    runs = []
    for m, dev in ((copy.deepcopy(model), "cpu"), (copy.deepcopy(model).to("xla"), "xla")):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True, amsgrad=amsgrad, maximize=maximize)
        scaler = torch.amp.GradScaler(dev, init_scale=1024.0)
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
        for i in range(3):
            loss = torch.nn.functional.mse_loss(m(x.to(dev)), t.to(dev))
            if overflow and i == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append([p.detach().cpu() for p in m.parameters()] + [torch.tensor(scaler.get_scale())])
    torch.testing.assert_close(runs[1], runs[0], rtol=100 * NOISE, atol=100 * NOISE)
