"""Checkpoint faults: damaged, truncated or missing files raise one clear error naming the file;
a save killed midway, onto a full disk or into a missing folder leaves the previous checkpoint."""

import errno
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.utils.serialization as xser

DEV = xm.xla_device()


def _small_checkpoint(tmp_path):
    path = str(tmp_path / "c.xser")
    xser.save({"a": torch.arange(64.0).to(DEV), "b": torch.ones(3, 3, device=DEV)}, path)
    (gdir,) = [os.path.join(path + ".tensors", g) for g in os.listdir(path + ".tensors")]
    return path, gdir


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


def _truncate(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


def test_xser_structure_file_every_flipped_byte_and_truncation_raise(tmp_path):
    path, _ = _small_checkpoint(tmp_path)
    good = open(path, "rb").read()
    for off in range(len(good)):
        _flip(path, off)
        with pytest.raises(xser.CheckpointError, match=path):
            xser.load(path)
        _flip(path, off)
    for keep in (0, 5, len(good) // 2, len(good) - 1):
        _truncate(path, keep)
        with pytest.raises(xser.CheckpointError, match=path):
            xser.load(path)
        open(path, "wb").write(good)
    assert torch.equal(xser.load(path)["b"], torch.ones(3, 3))


def test_xser_tensor_file_flipped_truncated_or_missing_raise(tmp_path):
    path, gdir = _small_checkpoint(tmp_path)
    victim = os.path.join(gdir, "tensor_1.pt")
    good = open(victim, "rb").read()
    for off in range(0, len(good), 7):
        _flip(victim, off)
        with pytest.raises(xser.CheckpointError, match=f"{victim}: corrupt tensor file"):
            xser.load(path)
        _flip(victim, off)
    _truncate(victim, len(good) - 10)
    with pytest.raises(xser.CheckpointError, match=f"{victim}: tensor file is"):
        xser.load(path)
    os.unlink(victim)
    with pytest.raises(xser.CheckpointError, match=f"{victim}: tensor file missing"):
        xser.load(path)
    os.rename(gdir, gdir + "-moved")
    with pytest.raises(xser.CheckpointError, match="tensor file missing"):
        xser.load(path)


def test_xser_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path, gdir = _small_checkpoint(tmp_path)
    real, calls = xser._write_tensor, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args)

    monkeypatch.setattr(xser, "_write_tensor", failing)
    with pytest.raises(OSError, match="disk full"):
        xser.save({"a": torch.zeros(64, device=DEV), "b": torch.zeros(3, 3, device=DEV)}, path)
    assert os.listdir(path + ".tensors") == [os.path.basename(gdir)]  # the partial generation is gone
    assert xser.load(path)["a"].tolist() == list(range(64))


def test_xser_load_of_plain_torch_save_file(tmp_path):
    path = str(tmp_path / "plain.pt")
    xm.save({"w": torch.arange(4.0).to(DEV)}, path)
    assert xser.load(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    _truncate(path, os.path.getsize(path) - 30)
    with pytest.raises(xser.CheckpointError, match=path):
        xser.load(path)
    with pytest.raises(FileNotFoundError):
        xser.load(tmp_path / "absent")


def _saved(tmp_path, n=1000):
    w = torch.arange(float(n)).to("xla")
    path = tmp_path / "ckpt.pt"
    xm.save({"w": w}, path)
    return path


def test_a_flipped_byte_in_tensor_data_is_an_error_naming_the_record(tmp_path):
    from xlatorch.runtime.execute.serialization import CheckpointCorruptError

    path = _saved(tmp_path)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    raw = bytearray(path.read_bytes())
    offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 100  # inside the data
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=f"record '{info.filename}'"):
        torch.load(path)


def test_a_truncated_checkpoint_is_an_error_naming_the_file(tmp_path):
    from xlatorch.runtime.execute.serialization import CheckpointCorruptError

    path = _saved(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointCorruptError, match="ckpt.pt is not a complete checkpoint"):
        torch.load(path, map_location="cpu")


def test_a_save_killed_midway_leaves_a_temporary_the_next_save_removes(tmp_path):
    import subprocess

    path = _saved(tmp_path, n=10)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ckpt.pt.{dead.pid}.0123456789ab.tmp"  # what a SIGKILLed writer leaves
    stale.write_bytes(b"partial")
    live = tmp_path / f".ckpt.pt.{os.getpid()}.ba9876543210.tmp"  # another writer, still running
    live.write_bytes(b"in progress")
    xm.save({"w": torch.ones(3).to("xla")}, path)
    assert not stale.exists() and live.exists()
    torch.testing.assert_close(torch.load(path)["w"], torch.ones(3))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KB tmpfs (needs root): writes past that fail with ENOSPC."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


def test_a_full_disk_raises_enospc_and_keeps_the_previous_checkpoint(small_disk):
    path = small_disk / "ckpt.pt"
    xm.save({"w": torch.ones(100).to("xla")}, path)
    with pytest.raises(OSError) as info:
        xm.save({"w": torch.ones(100_000).to("xla")}, path)  # 400 KB: does not fit
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    torch.testing.assert_close(torch.load(path)["w"], torch.ones(100))
    assert [p.name for p in small_disk.iterdir()] == ["ckpt.pt"]  # no temporary left behind


@pytest.mark.parametrize("previous", [True, False])
def test_xser_save_on_a_full_disk_raises_enospc_naming_the_path_and_leaves_no_partial_files(small_disk, previous):
    path = str(small_disk / "ckpt")
    if previous:
        xser.save({"w": torch.ones(100).to("xla")}, path)
    before = _files(small_disk)
    with pytest.raises(OSError) as info:  # not RuntimeError: "[enforce fail at inline_container.cc] unexpected pos"
        xser.save({"w": torch.ones(100_000).to("xla"), "b": torch.ones(3).to("xla")}, path)  # 400 KB: does not fit
    assert type(info.value) is OSError and info.value.errno == errno.ENOSPC
    assert info.value.filename == path and path in str(info.value)
    assert _files(small_disk) == before  # the new generation is gone; so is ckpt.tensors if this save made it
    if previous:
        torch.testing.assert_close(xser.load(path)["w"], torch.ones(100))


# --- damaged files: one error class, naming the file and what is wrong ----------------------


def _flip_all(raw: bytes, offsets) -> list[bytes]:
    return [raw[:o] + bytes([raw[o] ^ 0x20]) + raw[o + 1 :] for o in offsets]


def _damaged(raw: bytes) -> dict[str, bytes]:
    return {
        "empty": b"",
        "header": _flip_all(raw, [0])[0],  # CPU PyTorch: UnicodeDecodeError or UnpicklingError
        "header byte 2": _flip_all(raw, [2])[0],
        "first 10 bytes": raw[:10],
        "half": raw[: len(raw) // 2],
        "all but the last byte": raw[:-1],
        "garbage": b"\x00" * 64,
    }


_WRITERS = {"torch.save": torch.save, "xm.save": xm.save}
_LOADERS = {"torch.load": torch.load, "xser.load": xser.load}


@pytest.mark.parametrize("loader", list(_LOADERS))
@pytest.mark.parametrize("writer", list(_WRITERS))
def test_every_damaged_checkpoint_raises_checkpoint_corrupt_error_naming_the_file(tmp_path, writer, loader):
    from xlatorch.runtime.execute.serialization import CheckpointCorruptError

    path = str(tmp_path / "ckpt.pt")
    w = torch.arange(10.0).to("xla")
    _WRITERS[writer]({"w": w, "v": w[2:5]}, path)
    raw = open(path, "rb").read()
    load = _LOADERS[loader]
    for what, bad in _damaged(raw).items():
        open(path, "wb").write(bad)
        with pytest.raises(CheckpointCorruptError, match=re.escape(path)) as info:
            load(path)
        if what == "empty":
            assert "is empty (0 bytes)" in str(info.value)
    # Every single flipped byte: an error naming the file, or (padding, timestamps) the same tensors.
    for bad in _flip_all(raw, range(len(raw))):
        open(path, "wb").write(bad)
        try:
            got = load(path)
        except CheckpointCorruptError as e:
            assert path in str(e)
            continue
        assert torch.equal(got["w"].cpu(), torch.arange(10.0)) and torch.equal(got["v"].cpu(), torch.arange(2.0, 5.0))
    # One class, whoever loads: a RuntimeError, as PyTorch raises for nearly every damaged zip file.
    assert xser.CheckpointError is CheckpointCorruptError and issubclass(CheckpointCorruptError, RuntimeError)


def test_a_damaged_xser_checkpoint_raises_checkpoint_corrupt_error_naming_the_file(tmp_path):
    from xlatorch.runtime.execute.serialization import CheckpointCorruptError

    path, gdir = _small_checkpoint(tmp_path)
    raw = open(path, "rb").read()
    for what, bad in _damaged(raw).items():
        open(path, "wb").write(bad)
        with pytest.raises(CheckpointCorruptError, match=re.escape(path)) as info:
            xser.load(path)
        if what == "empty":
            assert "is empty (0 bytes)" in str(info.value)
    open(path, "wb").write(raw)
    victim = os.path.join(gdir, "tensor_0.pt")
    open(victim, "wb").close()
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{victim}: tensor file is 0 bytes")):
        xser.load(path)
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{victim} is empty (0 bytes)")):
        torch.load(victim)


# --- a missing directory --------------------------------------------------------------------


@pytest.mark.parametrize("save", [xm.save, xser.save], ids=["xm.save", "xser.save"])
def test_saving_into_a_missing_directory_raises_file_not_found_naming_the_path(tmp_path, save):
    path = str(tmp_path / "missing" / "ckpt.pt")
    with pytest.raises(FileNotFoundError) as info:
        save({"w": torch.ones(3).to("xla")}, path)
    assert info.value.filename == path and str(info.value) == f"[Errno 2] No such file or directory: '{path}'"
    assert os.listdir(tmp_path) == []  # nothing made: no directory, no temporary
