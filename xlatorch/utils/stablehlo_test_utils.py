"""``torch_xla.utils.stablehlo_test_utils``: helpers of torch_xla's StableHLO export tests.

The saved-model checks run a TensorFlow SavedModel (what torch_xla's ``tf_saved_model_integration``
writes) with TensorFlow and compare it with the ``torch.export`` program on CPU. They need the
``tensorflow`` package: without it ``has_tf_package()`` is False (tests skip those checks on it)
and the other two raise ``ModuleNotFoundError`` saying so.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

__all__ = [
    "compare_exported_program_and_saved_model_result",
    "has_tf_package",
    "load_save_model_and_inference",
    "wrap_func_as_nn_module",
]


@functools.lru_cache
def has_tf_package() -> bool:
    """Whether ``tensorflow`` can be imported (checked once)."""
    if importlib.util.find_spec("tensorflow") is None:
        return False
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


def wrap_func_as_nn_module(f: Callable) -> torch.nn.Module:
    """``f`` as the ``forward`` of a parameterless module, in eval mode (to ``torch.export`` it)."""

    class M(torch.nn.Module):
        def forward(self, *args):
            return f(*args)

    return M().eval()


def _tensorflow():
    if not has_tf_package():
        raise ModuleNotFoundError(
            "running a TensorFlow SavedModel needs the tensorflow package (pip install tensorflow); "
            "check stablehlo_test_utils.has_tf_package() first"
        )
    import tensorflow

    return tensorflow


def load_save_model_and_inference(path: str, args: tuple[Any, ...]) -> Any:
    """Load the SavedModel at ``path`` and call its ``f`` on ``args`` (CPU tensors, given to
    TensorFlow as constants); returns TensorFlow's outputs. Needs ``tensorflow``."""
    tf = _tensorflow()
    model = tf.saved_model.load(path)
    inputs = pytree.tree_map_only(torch.Tensor, lambda t: tf.constant(t.numpy()), args)
    return model.f(*inputs)


def compare_exported_program_and_saved_model_result(ep, saved_model_path: str, args: tuple, atol: float = 1e-7):
    """Assert that the SavedModel at ``saved_model_path`` and the exported program ``ep`` (run
    by PyTorch on CPU) give outputs of the same dtypes, equal within ``atol``; returns both as
    NumPy arrays, ``(torch's, tensorflow's)``. Needs ``tensorflow``."""
    tf_out = load_save_model_and_inference(saved_model_path, args)
    with torch.no_grad():
        torch_out = ep.module()(*args)
    if not isinstance(torch_out, tuple):
        torch_out = (torch_out,)
    assert len(torch_out) == len(tf_out), f"{len(torch_out)} outputs from torch, {len(tf_out)} from tensorflow"
    torch_np = tuple(t.numpy() for t in torch_out)
    tf_np = tuple(t.numpy() for t in tf_out)
    for a, b in zip(torch_np, tf_np):
        assert a.dtype == b.dtype, f"torch dtype: {a.dtype}, tf dtype: {b.dtype}"
        assert np.allclose(a, b, atol=atol), f"outputs differ by {np.abs(a - b).max()} > atol={atol}"
    return torch_np, tf_np
