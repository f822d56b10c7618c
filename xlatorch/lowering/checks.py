"""On-device checks: the conditions CPU PyTorch raises on, as values of the graph.

An ops.yaml entry's ``check`` expression calls these with the op's arguments (JAX values,
static arguments as Python values) and gives one result or a list of them. A result is
``(bad, value, position, exception type, message)``: ``bad`` a boolean scalar, ``value``
the first offending element and ``position`` its flat index (the message's ``{0}`` and
``{1}``), or None when there is nothing to check. The
runtime turns results into one extra output of the graph and raises at the sync
(``xlatorch/runtime/lower/checks.py``). Messages are CPU PyTorch's own.

CPU checks an index as its kernel reads it: where the kernel reads nothing (an index tensor
with no elements, broadcast to none, or a result or slice with none), nothing is checked,
and these conditions return None too. Conditions CPU raises on from the shapes alone are
rows that always fire (``always``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from torch.linalg import LinAlgError  # noqa: F401  (ops.yaml checks raise it: L.checks.LinAlgError)

from xlatorch.lowering.index import mask_values

__all__ = ["in_range", "always", "index_range", "select_range", "along_dim", "index_add_range", "advanced",
           "targets", "bag", "divisor", "negative_power", "index_out_of_range", "flat", "segments",
           "lu_pivots", "multinomial", "linalg_info", "one_hot"]  # fmt: skip


def _xp(x):
    """The array module for ``x``: numpy for a host array (a check decided before the step,
    ``runtime/plan/prechecks.py``), else jax.numpy (inside the graph)."""
    return np if type(x) is np.ndarray else jnp


def _within(x, low, high) -> bool:
    """Whether host array ``x`` (non-empty) lies in ``[low, high)``: two reductions, where the
    full condition takes ten numpy calls (a check decided on the host before each step)."""
    return type(x) is np.ndarray and low <= x.min() and x.max() < high


def in_range(index, low, high, exc, msg):
    """A result for ``index`` values outside ``[low, high)``; None for an empty index."""
    if index is None or not hasattr(index, "shape") or index.size == 0:
        return None
    if _within(index, low, high):  # the value and position are read only when a row fires
        return False, 0, 0, exc, msg
    xp = _xp(index)
    flat_index = index.reshape(-1).astype(np.int64)
    bad = (flat_index < low) | (flat_index >= high)
    pos = xp.argmax(bad)
    return xp.any(bad), flat_index[pos], pos, exc, msg


def one_hot(self, num_classes: int):
    """``one_hot``: CPU reads the classes, first that none is negative, then that each is
    below ``num_classes``."""
    wide = 1 << 62
    return [
        in_range(self, 0, wide, RuntimeError, "Class values must be non-negative."),
        in_range(self, -wide, num_classes, RuntimeError, "Class values must be smaller than num_classes."),
    ]


def always(exc, msg: str):
    """A result that fires whenever the op runs: CPU raises on the shapes alone."""
    return True, 0, 0, exc, msg


def _size(x, dim: int) -> int:
    return x.shape[dim] if x.ndim else 1


def _empty(x) -> bool:
    return math.prod(x.shape) == 0


def index_out_of_range(index, size: int, out=None):
    """IndexError, indices in ``[0, size)``; ``out``: the op's result, when CPU checks an index
    only as it writes the result (``embedding_dense_backward``): an empty one, nothing checked."""
    if out is not None and _empty(out):
        return None
    return in_range(index, 0, size, IndexError, "index out of range in self")


def index_range(self, dim: int, index):
    """``index_reduce``: ``index`` along ``dim`` of ``self``."""
    return index_out_of_range(index, _size(self, dim))


def select_range(self, dim: int, index):
    """``index_select`` / ``embedding``: as :func:`index_range`, but CPU checks a ``self`` of 2 or
    more dims with no elements apart (RuntimeError), and its ``dim`` must not be empty."""
    if self.ndim < 2 or not _empty(self) or index.size == 0:
        return index_range(self, dim, index)
    n = self.shape[dim % self.ndim]
    if n == 0:
        return always(RuntimeError, "index_select(): self indexing axis dim should be positive")
    return in_range(index, 0, n, RuntimeError, f"INDICES element is out of DATA bounds, id={{0}} axis_dim={n}")


def along_dim(self, dim: int, index, exc=RuntimeError, negative: bool = False, prefix: str = "",
              slices: bool = False):  # fmt: skip
    """``gather`` / ``scatter`` / ``index_copy`` ...: CPU's "index {} is out of bounds for
    dimension d with size n"; ``negative``: Python-style negative indices are valid; ``slices``:
    CPU walks ``self``'s slices across ``dim`` (``index_copy``, ``index_fill``), so when they
    have no elements nothing is checked."""
    d = dim % max(self.ndim, 1)
    n = _size(self, d)
    if slices and self.ndim and math.prod(self.shape[:d] + self.shape[d + 1 :]) == 0:
        return None
    msg = f"{prefix}index {{0}} is out of bounds for dimension {d} with size {n}"
    return in_range(index, -n if negative else 0, n, exc, msg)


def index_add_range(self, dim: int, index):
    """``index_add``: a ``self`` of 0 or 1 dims is checked as ``index_select`` is; a larger one
    as :func:`along_dim`, and not at all when it has no elements."""
    if self.ndim < 2:
        return index_range(self, dim, index)
    if _empty(self):
        return None
    return along_dim(self, dim, index)


def advanced(self, indices, values=None):
    """``x[i, j]`` / ``index_put_``: one IndexError result per index tensor (negative indices valid).

    CPU reads the indices while it walks the result (for ``index_put_``, the values it writes),
    whose shape is the indices' broadcast shape and ``self``'s other dims: when that has no
    elements, nothing is checked. An indexed dim of size 0 with a non-empty broadcast index is
    an error from the shapes alone. ``index_put_`` with a lone boolean mask: its ``values``
    broadcast to the indexing result, whose size along the mask is its count of Trues."""
    given = [(p, t) for p, t in enumerate(indices) if t is not None]
    if values is not None and len(given) == 1 and given[0][1].dtype in (jnp.bool_, jnp.uint8):
        return _mask_values(self, *given[0], values)
    ints = []  # (dim, index)
    d = 0  # the dim of ``self`` the next index applies to
    for index in indices:
        if index is not None and index.dtype in (jnp.bool_, jnp.uint8):
            d += index.ndim  # a boolean mask (lowered statically by index_put) has no bounds to check
            continue
        if index is not None and d < max(self.ndim, 1):
            ints.append((d, index))
        d += 1
    if not ints:
        return []
    shape = np.broadcast_shapes(*(i.shape for _, i in ints))
    if math.prod(shape) and any(_size(self, k) == 0 for k, _ in ints):
        return [always(IndexError, "index is out of bounds for dimension with size 0")]
    indexed = {k for k, _ in ints}
    if math.prod(shape) * math.prod(n for k, n in enumerate(self.shape) if k not in indexed) == 0:
        return []
    return [along_dim(self, k, index, IndexError, negative=True) for k, index in ints]


def _mask_values(self, p: int, mask, values):
    """``x[mask] = values``: CPU's "shape mismatch" unless ``values`` broadcast to the indexing
    result (``self``'s dims before the mask, its count of Trues, the dims after it)."""
    pre, rest = self.shape[:p], self.shape[p + mask.ndim :]
    dims = [str(n) for n in pre] + ["{0}"] + [str(n) for n in rest]
    msg = (f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to indexing result "
           f"of shape [{', '.join(dims)}]")  # fmt: skip
    k = mask_values(values.shape, pre, rest)
    if k == 1:
        return None
    n = _xp(mask).count_nonzero(mask)
    return k is None or n != k, n, 0, RuntimeError, msg


def flat(self, index, empty: str | None = None):
    """``take`` / ``put``: indices into the flattened tensor, negative ones valid; ``empty``: CPU's
    message when ``self`` has no elements and ``index`` has some."""
    n = self.size
    if empty is not None and n == 0 and index.size:
        return always(IndexError, empty)
    return in_range(index, -n, n, IndexError, f"out of range: tried to access index {{0}} on a tensor of {n} elements.")


def targets(self, target, ignore_index: int, class_dim: int | None = None):
    """``nll_loss``: every target is a class index in ``[0, C)`` or ``ignore_index``."""
    if class_dim is None:
        class_dim = 1 if self.ndim >= 2 else 0
    n = self.shape[class_dim]
    if target.size and _within(target, 0, n):  # ignore_index aside, every target is a class
        return False, 0, 0, IndexError, "Target {0} is out of bounds."
    xp = _xp(target)
    t = target.reshape(-1).astype(np.int64)
    bad = ((t < 0) | (t >= n)) & (t != ignore_index)
    if t.size == 0:
        return None
    pos = xp.argmax(bad)
    return xp.any(bad), t[pos], pos, IndexError, "Target {0} is out of bounds."


def bag(weight, indices):
    """``embedding_bag``: indices in ``[0, num_embeddings)``."""
    n = weight.shape[0]
    msg = f"Index {{1}} of input takes value {{0}} which is not in the valid range [0, {n})"
    return in_range(indices, 0, n, RuntimeError, msg)


def divisor(out, other):
    """Integer ``//``, ``%``, ``fmod``, ``div(rounding_mode=...)``: CPU raises on a zero divisor
    of an element it computes (none when ``out`` has no elements)."""
    xp = _xp(other)
    other = xp.asarray(other)
    if other.size == 0 or _empty(out):
        return None
    return xp.any(other == 0), 0, 0, RuntimeError, "ZeroDivisionError"


def negative_power(exponent):
    """Integral ``pow`` by a Scalar: CPU raises on a negative exponent, whatever the data (an
    empty tensor too), where XLA's integer power would give garbage."""
    xp = _xp(exponent)
    return xp.asarray(exponent) < 0, 0, 0, RuntimeError, "Integers to negative integer powers are not allowed."


_SEGMENT_LENGTH = ("Expected segment_length >= 0 to be true, but got false.  (Could this error message be "
                   "improved?  If so, please report an enhancement request to PyTorch.)")  # fmt: skip


def segments(data, lengths, offsets, unsafe: bool):
    """``segment_reduce``: no negative length; unless ``unsafe``, each row of ``lengths`` sums to
    the size of the reduced dim (the dim after ``lengths``' leading ones)."""

    def negative(seglen, msg):
        flat = seglen.reshape(-1)
        if flat.size == 0:
            return None
        pos = jnp.argmax(flat < 0)
        return jnp.any(flat < 0), flat[pos], pos, RuntimeError, msg

    if offsets is not None:
        return [negative(jnp.diff(offsets.astype(jnp.int64), axis=-1), _SEGMENT_LENGTH)]
    if unsafe:
        return [negative(lengths, _SEGMENT_LENGTH)]
    sums = jnp.sum(lengths.astype(jnp.int64), axis=-1).reshape(-1)
    wrong = sums != data.shape[lengths.ndim - 1]
    msg = ("segment_reduce(): Expected all rows of lengths along axis to sum to data.size(lengths.dim()-1) "
           "when !unsafe.")  # fmt: skip
    return [negative(lengths, "lengths contains negative value!"), (jnp.any(wrong), 0, 0, RuntimeError, msg)]


def lu_pivots(LU_data, LU_pivots, unpack_pivots: bool):
    """``lu_unpack``: every pivot in ``[1, LU.size(-2)]`` (checked only when unpacking them)."""
    if not unpack_pivots:
        return None
    msg = ("pivots passed to lu_unpack must be between 1 and LU.size(-2) inclusive.Did you properly pass the "
           "result of lu_factor?")  # fmt: skip
    return in_range(LU_pivots, 1, LU_data.shape[-2] + 1, RuntimeError, msg)


def multinomial(self, num_samples: int, replacement: bool):
    """``multinomial``: CPU's checks of the probabilities' values, in its order and with its
    messages (without replacement or for one draw: the whole tensor's range, then each row's
    sum; with replacement: each entry, then each row's sum). The device would draw from NaN or
    negative probabilities without a word. (Its arguments: ``V.multinomial``, at the call.)"""
    if self.size == 0:
        return None
    xp = _xp(self)
    p = xp.asarray(self).astype(np.float32)
    sums = xp.sum(p, axis=-1)
    zero = "invalid multinomial distribution (sum of probabilities <= 0)"
    if not replacement or num_samples == 1:
        valid = (xp.max(p) < np.inf) & (xp.min(p) >= 0)  # a NaN fails both
        msg = "probability tensor contains either `inf`, `nan` or element < 0"
        return [(~valid, 0, 0, RuntimeError, msg), (xp.any(sums == 0), 0, 0, RuntimeError, zero)]
    return [
        (xp.any(~(p >= 0)), 0, 0, RuntimeError,  # CPU's test: a NaN fails it first
         "invalid multinomial distribution (encountering probability entry < 0)"),
        (xp.any(~xp.isfinite(p)), 0, 0, RuntimeError,
         "invalid multinomial distribution (encountering probability entry = infinity or NaN)"),
        (xp.any(sums <= 0), 0, 0, RuntimeError, zero),
    ]  # fmt: skip


# ``_linalg_check_errors``'s messages, chosen by the caller's name as CPU chooses them (the first
# that the name contains), and whether CPU raises its linear-algebra error or a RuntimeError.
_LINALG_MESSAGES = (
    ("inv", "The diagonal element {0} is zero, the inversion could not be completed because the input matrix is "
            "singular.", True),
    ("solve", "The solver failed because the input matrix is singular.", True),
    ("cholesky", "The factorization could not be completed because the input is not positive-definite (the "
                 "leading minor of order {0} is not positive-definite).", True),
    ("svd", "The algorithm failed to converge because the input matrix is ill-conditioned or has too many repeated "
            "singular values (error code: {0}).", True),
    ("eig", "The algorithm failed to converge because the input matrix is ill-conditioned or has too many repeated "
            "eigenvalues (error code: {0}).", True),
    ("lu_factor", "U[{0},{0}] is zero and using it on lu_solve would result in a division by zero. If you still want "
                  "to perform the factorization, consider calling linalg.lu(A, pivot) or linalg.lu_factor_ex(A, pivot)",
     False),
)  # fmt: skip


def linalg_info(info, api_name: str, is_matrix: bool, linalg_error):
    """``_linalg_check_errors`` inside a compiled graph: the first non-zero ``info`` of a batch of
    factorizations (``{1}``, its batch element) raises CPU's error for ``api_name``; None when
    the name is not one CPU words an error for."""
    found = [(text, linalg) for key, text, linalg in _LINALG_MESSAGES if key in api_name]
    if not found:
        return None
    text, linalg = found[0]
    if info.size == 0:
        return None
    flat = info.reshape(-1)
    bad = flat != 0
    pos = jnp.argmax(bad)
    where = "" if is_matrix else ": (Batch element {1})"
    return jnp.any(bad), flat[pos], pos, linalg_error if linalg else RuntimeError, f"{api_name}{where}: {text}"


def ctc_lengths(log_probs, targets, input_lengths, target_lengths):
    """``_ctc_loss``'s lengths held on the device, checked as CPU's ``ctc_loss_allocate_outputs``:
    each input length in ``[0, T]``, each target length at least 0, and the targets holding
    them (a padded batch at least the longest; concatenated ones exactly their sum)."""
    why = " (while checking arguments for ctc_loss_allocate_outputs)"
    wide = 1 << 62
    t = log_probs.shape[0]
    got = "to have value {0}, but got value {{0}}" + why
    rows = [
        in_range(input_lengths, 0, wide, RuntimeError, "Expected input_lengths " + got.format("at least 0")),
        in_range(input_lengths, -wide, t + 1, RuntimeError, "Expected input_lengths " + got.format(f"at most {t}")),
        in_range(target_lengths, 0, wide, RuntimeError, "Expected target_lengths " + got.format("at least 0")),
    ]
    if targets.ndim == 2:
        n = targets.shape[1]
        msg = f"Expected tensor to have size at least {{0}} at dimension 1, but got size {n} for argument #2 'targets'"
        rows.append(in_range(target_lengths, -wide, n + 1, RuntimeError, msg + why))
    else:
        n = targets.shape[0]
        total = _xp(target_lengths).sum(target_lengths).reshape(1)
        msg = f"Expected tensor to have size {{0}} at dimension 0, but got size {n} for argument #2 'targets'"
        rows.append(in_range(total, n, n + 1, RuntimeError, msg + why))
    return rows
