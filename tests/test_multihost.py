"""Jobs over several hosts, simulated on this machine: each "host" is a launcher process with
its own ``XLATORCH_HOST_INDEX`` that runs ``xmp.spawn``; all of them join one coordinator
(``XLATORCH_COORDINATOR``, ``XLATORCH_NUM_HOSTS=2``), as on a real cluster. The workers and
the checks are those of the one-host tests (tests/test_distributed.py, tests/test_spmd.py).
"""

import os
import socket
import subprocess
import sys
import time

import pytest
import spmd_programs  # noqa: F401 (the workers' module must import in the hosts)
import test_distributed
import test_distributed_checkpoint
import test_spmd
import torch

from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hosts(target: str, args=(), per_host: int = 1, env=None, timeout: float = 300) -> list:
    """Start 2 hosts, each running ``xmp.spawn(target, args, nprocs=per_host)``; per host
    (exit code, stderr, seconds until it ended). A host still running at ``timeout`` is
    killed and reported as a hang."""
    port = _free_port()
    mod, fn = target.rsplit(".", 1)
    # ``fork``: the launcher (a warm child: torch and JAX imported, no backend started) forks
    # its worker, which so has them too; a ``spawn`` worker spends 5-6 s importing them.
    code = (f"import xlatorch.distributed.xla_multiprocessing as xmp, {mod}\n"
            f"xmp.spawn({mod}.{fn}, args={tuple(args)!r}, nprocs={per_host}, start_method='fork')")  # fmt: skip
    procs, t0 = [], time.monotonic()
    for host in range(2):
        e = dict(os.environ, XLATORCH_NUM_HOSTS="2", XLATORCH_HOST_INDEX=str(host),
                 XLATORCH_COORDINATOR=f"127.0.0.1:{port}", PYTHONPATH=os.pathsep.join([ROOT, TESTS]),
                 **(env or {}))  # fmt: skip
        procs.append(warm.Popen([sys.executable, "-c", code], env=e, cwd=ROOT, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))  # fmt: skip
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = f"HANG: still running after {timeout:g}s\n{err}"
        out.append((p.returncode, err, time.monotonic() - t0))
    return out


def _ok(hosts) -> None:
    for h, (rc, err, _) in enumerate(hosts):
        assert rc == 0, f"host {h}: {err[-3000:]}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Collectives, then DDP, as parts of one two-host job (``mp_workers.parts``)."""
    out = tmp_path_factory.mktemp("hosts")
    parts = [("collectives", ()), ("ddp", (test_distributed.DDP_STEPS, test_distributed.DDP_PER))]
    _ok(_run_hosts("mp_workers.parts", (str(out), parts)))
    return out


def test_collectives_over_two_hosts(job):
    test_distributed.assert_collectives_match_numpy(test_distributed._load(job / "collectives"))


def test_ddp_over_two_hosts(job):
    test_distributed.assert_ddp_equals_one_process(test_distributed._load(job / "ddp"))


def test_spmd_training_and_checkpoint_over_two_hosts_of_four_devices(tmp_path):
    # Each host's process owns 4 CPU devices; the (4, 2) mesh spans both hosts.
    _ok(_run_hosts("spmd_programs.multiprocess_worker", (str(tmp_path),), env={"CPU_NUM_DEVICES": "4"}))
    test_spmd.assert_two_processes_of_four_devices(tmp_path)


def test_sharded_checkpoint_save_and_restore_over_two_hosts(tmp_path):
    # torch.distributed.checkpoint with SPMDSavePlanner / SPMDLoadPlanner and CheckpointManager:
    # each host's process writes and reads the blocks of its own 2 devices.
    _ok(_run_hosts("test_distributed_checkpoint._mp_worker", (str(tmp_path),), env={"CPU_NUM_DEVICES": "2"}))
    test_distributed_checkpoint.assert_each_process_wrote_its_own_blocks(tmp_path)


def test_a_host_that_dies_stops_the_others_naming_it():
    # Host 1's process dies (SIGKILL) while host 0's waits for it in a collective: host 0 stops
    # once the heartbeat timeout passes, saying which process of which host was lost.
    timeout = 5
    hosts = _run_hosts("mp_workers.killed", env={"XLATORCH_HEARTBEAT_TIMEOUT": str(timeout)}, timeout=240)
    (rc0, err0, t0), (rc1, err1, _) = hosts
    assert rc1 != 0 and "process 1 of the job, host 1) died with signal SIGKILL" in err1, err1[-2000:]
    assert rc0 != 0 and "HANG" not in err0, err0[-2000:]
    assert "worker 0 (process 0 of the job, host 0) stopped: xlatorch: the job lost process 1 (host 1)" in err0, err0[
        -2000:
    ]
    assert t0 < 120  # bounded: the heartbeat timeout plus start-up, not JAX's 100 s + abort


def test_hosts_finishing_at_different_times_are_not_lost(tmp_path):
    # A process that leaves the job normally is not taken for a lost one by a process still
    # working long after its heartbeat timeout.
    _ok(_run_hosts("mp_workers.slow_last", (str(tmp_path),), env={"XLATORCH_HEARTBEAT_TIMEOUT": "2"}))
    assert sorted(torch.load(tmp_path / f"rank{r}.pt") for r in range(2)) == [0, 1]
