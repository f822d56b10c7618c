"""The guides' single-device snippets and the device API."""

import copy

import pytest
import torch

import xlatorch
import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
import xlatorch.runtime as xr


def test_create_and_print(capsys):
    t = torch.randn(2, 2, device=xm.xla_device())
    print(t.device)
    print(t)
    out = capsys.readouterr().out
    assert out.startswith("xla:0\ntensor([[")
    assert "device='xla:0'" in out
    assert torch.allclose(torch.tensor(eval(out.split("tensor(")[1].split(", device")[0])), t.cpu(), atol=1e-4)


def test_device_spellings():
    for dev in [xm.xla_device(), xlatorch.device(), torch.device("xla"), "xla", "xla:0"]:
        t = torch.zeros(3, device=dev)
        assert t.device == torch.device("xla", 0)
        assert t.is_xla and not torch.zeros(1).is_xla
    cpu = torch.arange(6.0).reshape(2, 3)
    x = cpu.to("xla")
    assert x.is_xla and torch.equal(x.cpu(), cpu) and torch.equal(x.to("cpu"), cpu)
    assert x.tolist() == cpu.tolist()
    assert x.sum().item() == 15.0


def test_set_default_device():
    torch.set_default_device("xla")
    t = torch.ones(2, 3)
    assert t.device.type == "xla"
    torch.set_default_device(None)
    assert torch.ones(1).device.type == "cpu"


def test_add_mm_linear_match_cpu():
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    t0, t1 = a.to(xm.xla_device()), b.to(xm.xla_device())
    torch.testing.assert_close((t0 + t1).cpu(), a + b)
    torch.testing.assert_close(t0.mm(t1).cpu(), a.mm(b))
    lin = torch.nn.Linear(10, 20)
    x = torch.randn(10)
    want = lin(x)
    got = copy.deepcopy(lin).to(xm.xla_device())(x.to(xm.xla_device()))
    assert got.device.type == "xla" and got.grad_fn is not None
    torch.testing.assert_close(got.cpu(), want.detach())


def test_cpu_module_on_xla_input_names_both_devices():
    l_in = torch.randn(10, device=xm.xla_device())
    linear = torch.nn.Linear(10, 20)
    with pytest.raises(RuntimeError, match="Input tensor is not an XLA tensor: torch.FloatTensor") as e:
        linear(l_in)
    assert "'cpu'" in str(e.value) and "xla:0" in str(e.value)


def test_device_queries():
    assert xm.get_xla_supported_devices() == ["xla:0"]
    assert xm.xla_device(0) == torch.device("xla", 0)
    with pytest.raises(RuntimeError, match="xla:3 does not exist"):
        xm.xla_device(3)
    with pytest.raises(IndexError, match="xla:10 does not exist"):  # torch_xla's exception
        xlatorch.device(10)
    assert xm.xla_device_hw(xm.xla_device()) == "CPU"
    assert xr.device_type() == "CPU"
    assert (xr.world_size(), xr.global_ordinal(), xr.local_ordinal()) == (1, 0, 0)
    assert xm.is_master_ordinal() and xm.is_master_ordinal(local=False)


def test_lazy_until_sync():
    x = torch.randn(4, 4, device="xla")
    xm.mark_step()
    met.clear_all()
    y = (x @ x).relu() + 1
    assert met.metric_data("ExecuteTime") is None  # nothing ran yet
    xlatorch.sync()
    assert met.metric_data("ExecuteTime")[0] == 1
    assert met.counter_value("MarkStep") == 1
    torch.testing.assert_close(y.cpu(), (x.cpu() @ x.cpu()).relu() + 1)


def test_save_load_device_tensors(tmp_path):
    t0 = torch.randn(2, 2, device=xm.xla_device())
    t1 = torch.randn(2, 2, device=xm.xla_device())
    torch.save((t0, t1), tmp_path / "tensors.pt")
    l0, l1 = torch.load(tmp_path / "tensors.pt", weights_only=False)
    assert l0.device.type == "xla" and torch.equal(l0.cpu(), t0.cpu()) and torch.equal(l1.cpu(), t1.cpu())
    torch.save((t0.cpu(), t1.cpu()), tmp_path / "cpu.pt")
    c0, c1 = torch.load(tmp_path / "cpu.pt")
    assert c0.device.type == "cpu" and torch.equal(c0.to(xm.xla_device()).cpu(), t0.cpu())


def test_xm_save_atomic_and_cpu(tmp_path):
    model = torch.nn.Linear(3, 2).to(xm.xla_device())
    xm.save(model.state_dict(), tmp_path / "m.pt")
    sd = torch.load(tmp_path / "m.pt")
    assert all(v.device.type == "cpu" for v in sd.values())
    assert torch.equal(sd["weight"], model.weight.cpu())
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]


def test_copy_copy_is_deep_and_view_is_alias():
    t = torch.zeros(3, device="xla")
    c = copy.copy(t)
    v = t.view(3)
    v.add_(1)
    t.add_(1)
    assert c.cpu().tolist() == [0.0, 0.0, 0.0]
    assert t.cpu().tolist() == [2.0, 2.0, 2.0] and v.cpu().tolist() == [2.0, 2.0, 2.0]


def test_detach_and_data_alias():
    p = torch.ones(3, device="xla")
    p.data.mul_(3)
    p.detach().add_(1)
    assert p.cpu().tolist() == [4.0, 4.0, 4.0]


def test_slice_assignment_updates_base():
    x = torch.zeros(3, 4, device="xla")
    x[:, 1:3] = torch.ones(3, 2, device="xla")
    x[0].add_(5)
    want = torch.zeros(3, 4)
    want[:, 1:3] = 1
    want[0] += 5
    assert torch.equal(x.cpu(), want)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int16, torch.int32,
     torch.int64, torch.uint8, torch.bool],
)  # fmt: skip
def test_dtypes_round_trip_and_compute(dtype):
    cpu = (torch.arange(12) % 7).to(dtype).reshape(3, 4)
    x = cpu.to("xla")
    assert x.dtype == dtype
    assert torch.equal(x.cpu(), cpu)
    if dtype != torch.bool:
        torch.testing.assert_close((x + x).cpu(), cpu + cpu)
        torch.testing.assert_close(x.sum(1).cpu(), cpu.sum(1))


def test_int64_and_float64_exact():
    big = torch.tensor([2**62 + 1, -(2**61) - 3], dtype=torch.int64)
    assert torch.equal((big.to("xla") + 1).cpu(), big + 1)
    f = torch.tensor([1.0 + 2**-50], dtype=torch.float64)
    assert torch.equal((f.to("xla") * 3).cpu(), f * 3)


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="unsupported dtype torch.uint16"):
        torch.zeros(2, dtype=torch.uint16).to("xla")


def test_a_sparse_tensor_is_a_clear_error_not_a_memory_format_one():
    """Sparse tensors cannot live on the device: moving one (or making one there, which runs
    on the CPU and moves the result) says so and what to do; it raised 'unsupported memory
    format option Contiguous'."""
    for make in (lambda: torch.eye(3).to_sparse().to("xla"), lambda: torch.eye(3, device="xla").to_sparse()):
        with pytest.raises(RuntimeError, match=r"torch.sparse_coo tensor cannot be moved to the xla device.*to_dense"):
            make()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_is_a_clear_error_naming_what_to_do():
    """A nested tensor cannot live on the device: moving one, or any op on one made there, says
    so and what to do (it was PyTorch's "Could not run 'aten::_to_copy' with arguments from the
    'NestedTensorxla' backend" and a list of every backend)."""
    parts = [torch.randn(2, 3), torch.randn(4, 3)]
    with pytest.raises(RuntimeError) as moved:
        torch.nested.nested_tensor(parts).to("xla")
    assert "aten::_to_copy got a nested tensor (torch.nested)" in str(moved.value)
    assert "to_padded_tensor" in str(moved.value)
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged)  # a Python subclass around its values
    with pytest.raises(RuntimeError, match=r"cannot make a nested tensor \(torch.nested\) on the xla device.*padded"):
        jagged.to("xla")
    with pytest.raises(RuntimeError, match=r"cannot make a nested tensor \(torch.nested\) on the xla device.*padded"):
        torch.nested.nested_tensor(parts, layout=torch.jagged, device="xla")
    made = torch.nested.nested_tensor(parts, device="xla")
    for op in (lambda t: t * 2, lambda t: t.unbind(), lambda t: t.to_padded_tensor(0.0)):
        with pytest.raises(RuntimeError, match=r"got a nested tensor \(torch.nested\) on the xla device.*dense"):
            op(made)


def test_xla_tensors_collated_in_a_dataloader_worker_say_what_to_do(monkeypatch):
    """A Dataset returning xla tensors to a DataLoader with workers: the worker collates the batch
    into shared CPU memory, which an xla tensor cannot reach. It said "xla tensors have no
    storage"; now what to do. (The worker's own collate runs here, with the worker info a worker
    process sets: forking this process's device runtime in a test could hang it.)"""
    from torch.utils.data._utils import worker

    x = torch.ones(2, device="xla")
    with pytest.raises(RuntimeError, match="no storage"):  # outside a worker: as before
        x.untyped_storage()
    monkeypatch.setattr(worker, "_worker_info", worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None))
    with pytest.raises(
        RuntimeError, match=r"DataLoader worker process cannot hand xla tensors.*CPU tensors.*MpDeviceLoader"
    ):
        torch.utils.data.default_collate([x, x])


_FORKS = """
import os, sys, torch
import xlatorch.core.xla_model as xm

def forked(body):  # the child's exit status: 0 if body returned
    pid = os.fork()
    if pid == 0:
        try:
            body()
        except BaseException as e:
            print("child raised", type(e).__name__, e, flush=True)
            os._exit(3)
        sys.exit(0)  # a normal exit: atexit hooks run
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

dev = xm.xla_device()
cpu = torch.randn(8, 8)

def before_start():  # a child forked before the runtime started starts its own
    torch.testing.assert_close((cpu.to(dev) @ cpu.to(dev)).cpu(), cpu @ cpu, rtol=1e-5, atol=1e-5)
print("before start", forked(before_start), flush=True)

x = cpu.to(dev)
torch.testing.assert_close((x @ x).cpu(), cpu @ cpu, rtol=1e-5, atol=1e-5)
pending = x * 2  # pending in the parent when it forks

def after_start():
    said = []
    for what, f in [("op", lambda: x @ x), ("upload", lambda: torch.ones(2).to(dev)), ("read", lambda: x.cpu()),
                    ("pending read", lambda: pending.cpu()), ("sync", xm.mark_step)]:
        try:
            f()
            said.append(what + " ran")
        except RuntimeError as e:
            assert "forked" in str(e) and "would hang" in str(e) and "spawn" in str(e), e
            said.append(what + " refused")
    assert torch.xla._is_in_bad_fork()
    print("child:", ", ".join(said), flush=True)
print("after start", forked(after_start), flush=True)

class Data(torch.utils.data.Dataset):  # a Dataset whose items are made on the device
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return x[i] * 2
loader = torch.utils.data.DataLoader(Data(), batch_size=2, num_workers=1, multiprocessing_context="fork")
try:
    next(iter(loader))
except RuntimeError as e:
    print("dataloader:", "forked" in str(e) and "MpDeviceLoader" in str(e), flush=True)
torch.testing.assert_close(pending.cpu(), cpu * 2)  # the parent goes on
print("parent ok", not torch.xla._is_in_bad_fork(), flush=True)
"""


def test_a_process_forked_after_the_device_started_refuses_device_work_instead_of_hanging():
    """JAX's runtime does not survive fork(): a forked child's first execution hung for good (a
    DataLoader worker whose Dataset made its items on the device, an os.fork child reading a
    result). Now each entry to the device in such a child (an op on an xla tensor, an upload, a
    read, a sync) raises an error saying why and what to do, the child exits normally, and the
    parent goes on. A child forked before the runtime started uses the device. In a subprocess,
    so that a hang fails this test by its timeout instead of hanging the suite."""
    import os
    import sys

    from tests import warm

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = warm.run([sys.executable, "-W", "ignore", "-c", _FORKS], env=dict(os.environ, PYTHONPATH=root),
                 capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        "before start 0",
        "child: op refused, upload refused, read refused, pending read refused, sync refused",
        "after start 0",
        "dataloader: True",
        "parent ok True",
    ], r.stdout + r.stderr[-3000:]


def test_static_args_that_hash_alike_do_not_share_an_executable():
    # hash(-1) == hash(-2) in CPython: the graph cache must compare static arguments themselves.
    cpu = torch.randn(3, 4)
    x = cpu.to("xla")
    a = torch.softmax(x, -2).cpu()
    b = torch.softmax(x, -1).cpu()
    torch.testing.assert_close(a, torch.softmax(cpu, -2))
    torch.testing.assert_close(b, torch.softmax(cpu, -1))


@pytest.mark.parametrize(
    "make",
    [
        lambda d: (torch.arange(4.0, device=d), torch.arange(4, device=d)),  # 4 == 4.0
        lambda d: (torch.full((2,), 1, device=d), torch.full((2,), True, device=d)),  # 1 == True
        lambda d: (torch.full((2,), 0.0, device=d), torch.full((2,), -0.0, device=d)),  # 0.0 == -0.0
    ],
)
def test_static_args_that_compare_equal_do_not_share_a_node(make):
    """Static numbers equal in Python but of another type or sign make other tensors."""
    for got, want in zip(make("xla"), make("cpu")):
        got = got.cpu()
        assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


def test_tensor_constructor_on_the_device():
    t = torch.tensor([[1, 2], [3, 4]], device="xla")
    assert t.device.type == "xla" and t.dtype == torch.int64
    assert torch.equal((t + 1).cpu(), torch.tensor([[2, 3], [4, 5]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_writing_the_host_tensor_after_an_upload_leaves_the_device_copy(dtype):
    x = torch.ones(5, dtype=dtype)
    d = x.to("xla")
    x.mul_(2)
    assert torch.equal(d.cpu(), torch.ones(5, dtype=dtype))


def _chain(x, n):
    """``n`` rounds of ops on whole numbers in float64 (exact on every device; integers would
    run on the host), each reading the last: a graph ``3 n`` nodes deep whose nodes read a leaf
    before their pending operand."""
    for i in range(n):
        x = torch.remainder(torch.tensor(i % 7.0, dtype=x.dtype) + x * 3, 1000003)  # a 0-d CPU tensor: a leaf
    return x


def test_a_graph_deeper_than_the_walks_recursion_and_one_synced_from_a_deep_stack_share_an_executable(monkeypatch):
    """``collect`` recurses ``DEEP`` levels, then goes on with an explicit stack; a caller whose
    own stack leaves no room for it gets the same walk without recursion. All three orders must
    be the same graph: equal values, and the deep-stack sync reuses the executable."""
    from xlatorch.runtime.plan import collect as C

    n = C.DEEP  # 3 DEEP levels
    start = torch.arange(5, dtype=torch.float64)
    want = _chain(start, n)
    d = start.to("xla")
    before = (met.metric_data("CompileTime") or (0,))[0]
    assert torch.equal(_chain(d, n).cpu(), want)
    compiles = met.metric_data("CompileTime")[0]
    assert compiles == before + 1
    flat = []
    real = C._Walk.graph

    def graph(self, roots, deep):
        flat.append(deep)
        return real(self, roots, deep)

    monkeypatch.setattr(C._Walk, "graph", graph)

    def deep_stack(k):  # the sync from near Python's recursion limit
        return deep_stack(k - 1) if k else _chain(d, n).cpu()

    import sys

    got = deep_stack(sys.getrecursionlimit() - 150)
    assert torch.equal(got, want)
    assert flat == [C.DEEP, -1]  # recursion ran out, and the walk without it made the graph
    assert met.metric_data("CompileTime")[0] == compiles  # the same key: no compile


def test_the_walk_with_a_stack_gives_the_recursive_walks_graph():
    """A training step's graph (ops with several outputs, tuple operands, shared leaves, many
    roots) collected both ways: the same nodes, leaves and encoding, so one cache key."""
    from xlatorch.runtime.plan import collect as C
    from xlatorch.runtime.trace.tensor import pending_storages

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    model = model.to("xla")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(4, 6).to("xla")
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        target = torch.tensor([0, 1, 2, 0] * 2).to("xla")
        loss = torch.nn.functional.cross_entropy(torch.cat([out, out.flip(0)]), target)
        loss.backward()
        opt.step()
        roots = [st.value for st in pending_storages()]
        a, b = C.collect(roots), C._Walk().graph(roots, -1)
        assert len(a.nodes) > 30 and any(type(arg) is tuple for n in a.nodes for arg in n.args)
        assert a.nodes == b.nodes and a.leaves == b.leaves and a.enc == b.enc and a.root_refs == b.root_refs
        xm.mark_step()
