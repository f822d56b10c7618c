"""Sync-free optimizers: ``torch.optim``'s SGD, Adam and AdamW whose ``step`` takes
``found_inf`` (a device tensor, from ``xlatorch.amp.GradScaler``) and skips the update on
the device when it is non-zero, with a select in the graph instead of a host ``if``."""

from xlatorch.amp.syncfree.optimizers import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW"]
