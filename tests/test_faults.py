"""Faults cost at most the step they hit: interrupts (Ctrl-C) during training.

Each test runs a training program in a subprocess (bounded time) and injects the fault
the way a user meets it; the model must survive, equal to an uninterrupted run step for
step.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Trains a small MLP on one fixed batch (so the state after m applied steps is the
# reference's after m steps, whichever steps an interrupt skipped), first without
# interrupts (the reference), then while a thread sends SIGINT at random times. Like many
# training scripts, it catches KeyboardInterrupt, saves a checkpoint and carries on.
_PROGRAM = textwrap.dedent(
    """
    import os, random, signal, sys, threading, time
    # Ctrl-C at a terminal reaches a foreground program with Python's handler. A program
    # started from a shell script's background job (as a test runner may be) inherits SIGINT
    # ignored, and Python then leaves it ignored: no signal would land.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch, torch.nn as nn, torch.nn.functional as F
    import xlatorch, xlatorch.core.xla_model as xm

    seed, n_signals, opt_name, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dev = xm.xla_device()

    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(dev)
        opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=0.01))
        return model, opt

    def state(model, opt):
        s = {"p" + str(i): p.detach().cpu().clone() for i, p in enumerate(model.parameters())}
        for i, p in enumerate(model.parameters()):
            for k, v in opt.state.get(p, {}).items():
                s[f"o{i}.{k}"] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
        return s

    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=g).to(dev)
    y = torch.randint(0, 8, (32,), generator=g).to(dev)

    def step(model, opt):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        xm.mark_step()

    model, opt = setup()
    for _ in range(3):  # compiled before the signals start: they are to land on steps, not compiles
        step(model, opt)
    model, opt = setup()
    rng = random.Random(seed)
    stop = threading.Event()
    def pester():
        for _ in range(n_signals):
            if stop.wait(rng.uniform(0.005, 0.04)):
                return
            os.kill(os.getpid(), signal.SIGINT)
        stop.set()
    sender = threading.Thread(target=pester)  # started inside the try below: no signal before it
    saved, done = [], [0]
    t_end = time.time() + 120  # a bound for a stuck run, not a speed goal

    def checkpoint():
        while True:
            try:
                saved.append(state(model, opt))   # "save a checkpoint"
                return
            except KeyboardInterrupt:
                continue

    def train():
        # Until every signal was sent, however fast the steps run and however late a busy
        # machine wakes the sender.
        while not stop.is_set() and time.time() < t_end:
            try:
                step(model, opt)
                done[0] += 1
            except KeyboardInterrupt:
                checkpoint()

    # Ctrl-C lands on a line of this program; the loop's own lines (while, try) are lines
    # too, so an interrupt there leaves train() and is caught here.
    started = False
    while True:
        try:
            if not started:
                started = True
                sender.start()
            train()
            break
        except KeyboardInterrupt:
            checkpoint()
    while True:  # a signal sent last may land here: wait for the sender, then ignore SIGINT
        try:
            stop.set()
            sender.join()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            break
        except KeyboardInterrupt:
            pass

    # The reference: the same steps without interrupts, a state after each, as many steps as
    # the interrupted run can have applied (each caught interrupt may have followed a step
    # that committed before its count).
    final = state(model, opt)
    model, opt = setup()
    reference = [state(model, opt)]
    for _ in range(done[0] + len(saved) + 2):
        step(model, opt)
        reference.append(state(model, opt))
    def match(s):
        for k, r in enumerate(reference):
            if s.keys() == r.keys() and all(torch.equal(s[n], r[n]) for n in s):
                return k
        return None
    ks = [match(s) for s in saved]
    print("CHECKPOINTS", len(saved), "MATCHED", ks, "FINAL", match(final))
    """
)


@pytest.mark.parametrize("seed,optimizer", [(1, "sgd"), (2, "adamw"), (3, "sgd")])
def test_ctrl_c_never_loses_the_model(tmp_path, seed, optimizer):
    script = tmp_path / "train.py"
    script.write_text(_PROGRAM)
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, str(script), str(seed), "30", optimizer, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = next(s for s in r.stdout.splitlines() if s.startswith("CHECKPOINTS"))
    n = int(line.split()[1])
    assert n >= 10, line  # the interrupts landed
    matched = line.split("MATCHED ")[1].split(" FINAL")[0]
    assert "None" not in matched, line  # every checkpoint is the model after a whole number of steps
    assert "FINAL None" not in line, line


def _sgd_reference(w0, x, lr):
    w = w0.clone().requires_grad_()
    (w @ x).square().sum().backward()
    with torch.no_grad():
        return w - lr * w.grad


def test_a_failed_op_costs_only_what_depends_on_it(monkeypatch, no_cached_executables):
    import torch
    from xlatorch._generated import dispatch as table

    import xlatorch.core.xla_model as xm
    from xlatorch.runtime.ir.failed import FailedValueError

    w0, x = torch.randn(4, 3), torch.randn(3, 5)
    w = w0.to("xla").requires_grad_()
    opt = torch.optim.SGD([w], lr=0.1)
    xm.mark_step()

    def broken(out, self):
        raise ZeroDivisionError("this lowering exploded")

    monkeypatch.setattr(table.S_sin, "emit", broken)
    (w @ x.to("xla")).square().sum().backward()
    opt.step()
    bad = x.to("xla").sin() + 1  # the same step, unrelated to the update
    with pytest.raises(ZeroDivisionError, match="this lowering exploded") as info:
        xm.mark_step()
    assert any("aten::sin" in note for note in getattr(info.value, "__notes__", []))
    monkeypatch.undo()
    torch.testing.assert_close(w.detach().cpu(), _sgd_reference(w0, x, 0.1))  # the update was committed
    with pytest.raises(FailedValueError, match="this lowering exploded"):
        bad.cpu()
    torch.testing.assert_close((w * 2).detach().cpu(), _sgd_reference(w0, x, 0.1) * 2)  # training goes on


def test_a_failed_lowering_in_a_step_that_hoists_optimizer_state_fails_only_what_depends_on_it(
    monkeypatch, no_cached_executables
):
    """Adam's first step computes its state's constants apart (runtime/plan/births.py), so the
    graph that fails to lower is a new one: the node that failed is found in it, not at the
    same position of the graph before (which failed an unrelated tensor)."""
    import torch
    from xlatorch._generated import dispatch as table

    import xlatorch.core.xla_model as xm
    from xlatorch.runtime.ir.failed import FailedValueError

    w0, x = torch.randn(4, 3), torch.randn(3, 5)
    w = w0.to("xla").requires_grad_()
    opt = torch.optim.Adam([w], lr=0.1)
    xd = x.to("xla")
    xm.mark_step()

    def broken(out, self):
        raise ZeroDivisionError("this lowering exploded")

    monkeypatch.setattr(table.S_sin, "emit", broken)
    unrelated = xd.cos() + 1
    (w @ xd).square().sum().backward()
    opt.step()
    bad = xd.sin() + 2
    with pytest.raises(ZeroDivisionError, match="this lowering exploded"):
        xm.mark_step()
    monkeypatch.undo()
    torch.testing.assert_close(unrelated.cpu(), x.cos() + 1)
    with pytest.raises(FailedValueError, match="this lowering exploded"):
        bad.cpu()
    ref = w0.clone().requires_grad_()
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    (ref @ x).square().sum().backward()
    ref_opt.step()
    torch.testing.assert_close(w.detach().cpu(), ref.detach())  # the update was committed


def test_an_out_of_memory_graph_costs_only_its_part():
    import torch

    import xlatorch.core.xla_model as xm
    from xlatorch.runtime.ir.failed import FailedValueError

    w0, x = torch.randn(4, 3), torch.randn(3, 5)
    w = w0.to("xla").requires_grad_()
    opt = torch.optim.SGD([w], lr=0.1)
    q = torch.ones(3, device="xla")
    xm.mark_step()
    (w @ x.to("xla")).square().sum().backward()
    opt.step()
    huge = torch.ones(2**38, device="xla") * 2  # 1 TiB
    q.add_(huge.sum())  # an in-place update in the part that cannot run
    with pytest.raises(torch.OutOfMemoryError, match="RESOURCE_EXHAUSTED"):
        xm.mark_step()
    torch.testing.assert_close(w.detach().cpu(), _sgd_reference(w0, x, 0.1))  # committed
    torch.testing.assert_close(q.cpu(), torch.ones(3))  # kept its value from before the step
    with pytest.raises(FailedValueError, match="RESOURCE_EXHAUSTED"):
        huge.cpu()


def _model(seed):
    # From a generator of its own: threads share torch's global RNG.
    g = torch.Generator().manual_seed(100 + seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _train(seed, device, steps=12, bad_step=None):
    import torch.nn.functional as F

    import xlatorch.core.xla_model as xm

    model = _model(seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=g).to(device)
    y = torch.randint(0, 4, (64,), generator=g).to(device)
    losses, errors = [], []
    for i in range(steps):
        try:
            opt.zero_grad()
            target = torch.full_like(y, 9) if i == bad_step else y  # 9: out of range
            loss = F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            if device != "cpu":
                xm.mark_step()
            losses.append(loss.item())
        except IndexError as e:
            errors.append(e)
    return losses, errors


def test_two_threads_train_their_own_models_and_keep_their_own_errors():
    import threading

    expected = _train(1, "cpu")[0]
    results, crashes = {}, []

    def run(seed, bad):
        try:
            results[seed] = _train(seed, "xla", bad_step=bad)
        except BaseException as e:  # anything escaping is a failure of the test
            crashes.append((seed, e))

    threads = [threading.Thread(target=run, args=(1, None)), threading.Thread(target=run, args=(2, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not crashes, crashes
    losses1, errors1 = results[1]
    assert not errors1  # thread 2's bad target never surfaces in thread 1
    torch.testing.assert_close(losses1, expected, rtol=1e-5, atol=1e-6)
    losses2, errors2 = results[2]
    assert len(errors2) == 1 and "Target 9 is out of bounds" in str(errors2[0])
    # The failed step changed nothing: thread 2 trained 11 good steps, as CPU skipping step 4.
    cpu2 = _train_skipping(2, skip=4)
    torch.testing.assert_close(losses2, cpu2, rtol=1e-5, atol=1e-6)


def test_a_fault_found_by_another_threads_sync_is_raised_once_in_its_owner():
    # Thread A's sync runs thread B's step while B's backward pass is still tracing: the step's
    # check fails, B's error is left for B, and the rest of B's backward pass reads the failed
    # values. B raises CPU's IndexError from backward(); A's next sync meets B's gradients (they
    # read the failed values) and once gave B a second error, FailedValueError, at B's next op.
    import threading

    import torch.nn.functional as F

    import xlatorch.core.xla_model as xm

    in_backward, synced = threading.Event(), threading.Event()

    class Pause(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            in_backward.set()
            assert synced.wait(60)
            return g * 1

    out, crashes = {}, []

    def thread_b():
        try:
            model = _model(3).to("xla")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(3)
            x = torch.randn(8, 16, generator=g).to("xla")
            y = torch.randint(0, 4, (8,), generator=g).to("xla")
            try:
                F.cross_entropy(Pause.apply(model(x)), torch.full_like(y, 9)).backward()
            except IndexError as e:
                out["first"] = e
            in_backward.set()
            out["a_done"] = a_done.wait(60)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            xm.mark_step()
            out["loss"] = loss.item()
            out["params"] = [p.cpu() for p in model.parameters()]
        except BaseException as e:  # noqa: BLE001 (anything escaping fails the test)
            crashes.append(e)
            in_backward.set()

    a_done = threading.Event()
    b = threading.Thread(target=thread_b)
    b.start()
    assert in_backward.wait(120)
    xm.mark_step()  # runs B's step so far: its check fails, B's error is left for B
    synced.set()
    in_backward.clear()
    assert in_backward.wait(120)  # B has raised its error
    xm.mark_step()  # B's gradients read the failed values
    a_done.set()
    b.join(120)
    assert not crashes, crashes
    assert "Target 9 is out of bounds" in str(out["first"])
    # B's model is untouched by the failed step: its good step equals CPU's.
    model = _model(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    torch.testing.assert_close(out["loss"], loss.item(), rtol=1e-5, atol=1e-6)
    for got, want in zip(out["params"], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def _train_skipping(seed, skip, steps=12):
    import torch.nn.functional as F

    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=g)
    y = torch.randint(0, 4, (64,), generator=g)
    losses = []
    for i in range(steps):
        if i == skip:
            continue
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_reading_a_failed_value_raises_in_any_thread(monkeypatch, no_cached_executables):
    import threading

    from xlatorch._generated import dispatch as table

    import xlatorch.core.xla_model as xm
    from xlatorch.runtime.ir.failed import FailedValueError

    def broken(out, self):
        raise ZeroDivisionError("exploded")

    monkeypatch.setattr(table.S_cos, "emit", broken)
    bad = torch.ones(3, device="xla").cos()
    with pytest.raises(ZeroDivisionError):
        xm.mark_step()
    monkeypatch.undo()
    seen = []

    def read():
        try:
            bad.cpu()
            seen.append("no error")
        except FailedValueError as e:
            seen.append(e)

    t = threading.Thread(target=read)
    t.start()
    t.join()
    assert len(seen) == 1 and isinstance(seen[0], FailedValueError), seen


_LAUNCHER = textwrap.dedent(
    """
    import os, sys, time
    import xlatorch.distributed.xla_multiprocessing as xmp

    def fn(index, out):
        import torch, xlatorch.core.xla_model as xm
        with open(os.path.join(out, f"worker{index}"), "w") as f:
            f.write(f"{os.getpid()} {os.environ['XLATORCH_COORDINATOR']}")
        while True:  # a long training run
            (torch.ones(4, device="xla") * 2).sum().item()
            time.sleep(0.05)

    if __name__ == "__main__":
        xmp.spawn(fn, args=(sys.argv[1],), nprocs=2, start_method=sys.argv[2])
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def _listening(port: int) -> bool:
    """Whether a socket on this machine listens on TCP ``port`` (/proc/net/tcp, tcp6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


# A forkserver worker's parent is the fork server, not the launcher; a fork worker holds
# copies of everything the launcher had open.
@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_workers_die_with_a_killed_launcher(tmp_path, start_method):
    import signal
    import time

    script = tmp_path / "launch.py"
    script.write_text(_LAUNCHER)
    launcher = warm.Popen([sys.executable, str(script), str(tmp_path), start_method],
                          env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not all((tmp_path / f"worker{i}").exists() for i in range(2)):
            assert time.time() < deadline and launcher.poll() is None, "workers did not start"
            time.sleep(0.2)
        time.sleep(0.5)
        info = [(tmp_path / f"worker{i}").read_text().split() for i in range(2)]
        pids = [int(p) for p, _ in info]
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        t0 = time.time()
        while any(_alive(p) for p in pids) and time.time() - t0 < 10:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "workers outlived their launcher by 10 s"
        port = int(info[0][1].rsplit(":", 1)[1])
        t0 = time.time()  # nothing listens on the coordinator's port any more (another job may use it otherwise)
        while _listening(port) and time.time() - t0 < 10:
            time.sleep(0.2)
        assert not _listening(port), f"the coordinator's port {port} is still listened on"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_waiting_from_another_thread_while_a_step_takes_the_last_outputs():
    # xm.wait_device_ops() waits for the newest execution's outputs; another thread's step may
    # already have taken (donated) them, and the wait raised "deleted or donated buffer".
    import threading

    import jax
    import numpy as np

    import xlatorch.core.xla_model as xm
    from xlatorch.runtime.execute import sync

    taken, kept = jax.device_put(np.ones(3)), jax.device_put(np.ones(3))
    taken.delete()  # as a newer execution that began in another thread leaves it
    sync._last[:] = [kept, taken]
    xm.wait_device_ops()
    errors, done = [], threading.Event()

    def waiter():
        while not done.is_set():
            try:
                xm.wait_device_ops()
            except Exception as e:  # noqa: BLE001 (any error fails the test)
                errors.append(e)
                return

    t = threading.Thread(target=waiter)
    t.start()
    try:
        losses = _train(5, "xla", steps=8)[0]  # trained while the other thread waits
        torch.testing.assert_close(losses, _train(5, "cpu", steps=8)[0], rtol=1e-5, atol=1e-6)
    finally:
        done.set()
        t.join(60)
    assert not errors, errors
