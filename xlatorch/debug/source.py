"""The user's source line (``xlatorch.runtime.base.source``, where the runtime records it)."""

from xlatorch.runtime.base.source import fmt_src, user_frame, user_line

__all__ = ["user_frame", "user_line", "fmt_src"]
