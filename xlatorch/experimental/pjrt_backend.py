"""``torch_xla.experimental.pjrt_backend``: DDP guides import it for its side effect, the
``xla://`` init method of ``torch.distributed``; in xlatorch that is registered by
``xlatorch.distributed.xla_backend``, which importing this module imports."""

from xlatorch.distributed import xla_backend  # noqa: F401  (registers the xla backend and xla://)
