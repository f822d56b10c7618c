"""Workers for the point-to-point collectives' tests (xm.collective_permute, xm.send, xm.recv),
run by ``xmp.spawn`` from tests/test_torch_xla_names.py. Each writes what it computed to
``<out>/rank<ordinal>.pt``; the test compares with values computed on CPU."""

import os

import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
import xlatorch.runtime as xr


def value(r: int) -> torch.Tensor:
    """Replica ``r``'s input (distinct on every replica)."""
    return torch.arange(6.0).reshape(2, 3) * (r + 1) + 10 * r


def permute_send_recv(index, out):
    d = xm.xla_device()
    n, r = xr.world_size(), xr.global_ordinal()
    x = value(r).to(d)
    res = {
        "ring": xm.collective_permute(x * 2, [[i, (i + 1) % n] for i in range(n)]),
        "partial": xm.collective_permute(x, [[n - 1, 0]]),  # only replica 0 receives: zeros elsewhere
        "ints": xm.collective_permute(torch.full((3,), r, dtype=torch.int64, device=d), [[0, 1], [1, 0]]),
    }
    xm.mark_step()
    res = {k: v.cpu() for k, v in res.items()}
    # Point to point: replica 0 sends (and drops what send returns), replica 1 receives into a
    # buffer; their steps hold different work around the one transfer.
    if r == 0:
        y = x.exp()
        xm.send(y, 1)
        other = (y + 1).sum()
        xm.mark_step()
        res["sent"], res["other"] = y.cpu(), other.cpu()
    else:
        buf = torch.zeros(2, 3, device=d)
        got = xm.recv(buf, 0)
        twice = got * 2
        xm.mark_step()
        res["buf"], res["got"], res["twice"] = buf.cpu(), got.cpu(), twice.cpu()
    res["permutes"] = met.counter_value("xla::collective_permute")
    torch.save(res, os.path.join(out, f"rank{r}.pt"))
