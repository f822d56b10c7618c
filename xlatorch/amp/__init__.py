"""``xlatorch.amp``: mixed precision on the device (``torch_xla.amp``).

- ``autocast(device, enabled=True, dtype=None, cache_enabled=True)``: ``torch.autocast("xla")``
  with bfloat16 by default; the op policy is the table in ``xlatorch.amp.policy``.
- ``GradScaler``: loss scaling for float16 with no host sync per step.
- ``syncfree.SGD``, ``syncfree.Adam``, ``syncfree.AdamW``: ``torch.optim``'s updates, skipped
  on the device when the scaler found an inf or NaN.
"""

from xlatorch.amp import syncfree
from xlatorch.amp.autocast_mode import autocast
from xlatorch.amp.grad_scaler import GradScaler

__all__ = ["autocast", "GradScaler", "syncfree"]
