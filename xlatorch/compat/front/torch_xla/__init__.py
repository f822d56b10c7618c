"""Stub on the path of the processes that ``python -m xlatorch.compat`` starts, and nowhere else:
its first import installs the aliases (``xlatorch.compat.aliases``) and ``torch_xla`` resolves to xlatorch."""

from xlatorch.compat.aliases import replace_stub

replace_stub(__name__)
