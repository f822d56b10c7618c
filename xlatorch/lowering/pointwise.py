"""Pointwise math whose lowering is more than one expression.

Each function follows the scalar formula of PyTorch's CPU kernel for the op, so
edge cases (NaN, signed zeros, poles, integer rounding) come out the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xlatorch.lowering import rng


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


HALF = (jnp.bfloat16, jnp.float16)


def wide(x):
    """A bfloat16 / float16 value in float32, others as they are: CPU's kernels compute half
    floats in float32 (their accumulation type) and round the result once."""
    return x.astype(jnp.float32) if x.dtype in HALF else x


def rounded(v, dtype):
    """``v`` rounded to ``dtype`` and back (``dtype`` None: ``v`` as it is): a value CPU's kernel
    stores in a half float between its steps (a composite's op result, a row's sum)."""
    return v if dtype is None else v.astype(dtype).astype(v.dtype)


def _is_one(s) -> bool:
    """Whether ``s`` is a constant 1 (a Scalar argument at its default lowers to one). A traced
    ``s`` (a number the program passed) is not known."""
    if type(s) is int or type(s) is float:
        return s == 1
    if isinstance(s, jax.core.Tracer) or not isinstance(s, jax.Array) or s.shape:
        return False
    known = _CONSTANTS.get(id(s))
    if known is None or known[0] is not s:
        known = (s, np.dtype(s.dtype).kind != "c" and bool(np.asarray(s) == 1))
        if len(_CONSTANTS) < 1024:
            _CONSTANTS[id(s)] = known  # holds ``s``: its id is not reused
    return known[1]


# Constants seen by ``_is_one`` and whether each is 1: the defaults' constants are made once
# (``runtime/base/dtypes.weak_number``) and recur in every graph.
_CONSTANTS: dict = {}


def _complex(x) -> bool:
    dtype = getattr(x, "dtype", None)  # a Python number on the compiled path (trace/fx.py)
    return isinstance(x, complex) if dtype is None else np.dtype(dtype).kind == "c"


def times(x, s):
    """``x * s`` (``alpha`` of add / sub); where ``s`` is a constant 1, ``x`` itself (real: bit
    for bit the product) or, complex, CPU's product by ``1 + 0j``, which XLA would fold to
    ``x``: a part times 0 is NaN where the other part is infinite (``inf + nanj``). Every add
    of a training step has ``alpha=1``: a multiply XLA folds away still costs lowering time
    (a sixth of a chain of ``t + 1``, ``bench.long_graph``)."""
    if not _is_one(s):
        return x * s
    if not _complex(x):
        return x
    re, im = jnp.real(x), jnp.imag(x)
    zero = jnp.zeros((), re.dtype)
    return lax.complex(re - zero * im, im + zero * re)


def in_result_dtype(out, x):
    """``x`` (an operand already in the computation dtype, a Python number on the compiled
    path, or the constant 1) rounded to the result's dtype and back where the result is a half
    float computed in float32: CPU's kernels of add / sub / rsub, fmod, remainder and pow take
    every operand, numbers and ``alpha`` included, in the result's dtype (``bf16 + 0.1`` adds
    bfloat16's 0.1, 0.10009766; ``fmod(x, 0.3)`` divides by 0.30078125) and compute in
    float32. A no-op for operands already of the result's dtype, and for integers (an integer
    exponent stays one)."""
    if out.dtype not in HALF or _is_one(x) or type(x) is int:
        return x
    if type(x) is float:
        return lax.convert_element_type(lax.convert_element_type(x, out.dtype), jnp.float32)
    if x.dtype == out.dtype or np.dtype(x.dtype).kind != "f":
        return x
    return x.astype(out.dtype).astype(jnp.float32)


def add(out, a, b, alpha, sign=1):
    """``a + alpha * b`` (``sign=-1``: ``a - alpha * b``) as CPU's kernel: operands and alpha in
    the result's dtype, computed in the computation dtype (float32 for half floats)."""
    a, b, alpha = in_result_dtype(out, a), in_result_dtype(out, b), in_result_dtype(out, alpha)
    return a + times(b, alpha) if sign > 0 else a - times(b, alpha)


def beta_alpha(out, self, beta, prod, alpha):
    """``beta * self + alpha * prod`` as ``addmm`` / ``baddbmm`` compute it: ``self`` ignored
    (NaN included) where beta is 0, and integer results truncating beta and alpha to the
    result's dtype, as PyTorch does; real defaults of 1 lower to no multiply. A half-float
    ``prod`` comes in float32 (``accumulated``): CPU's kernel scales and adds the float32 sums
    with beta and alpha in float32 and rounds once."""
    acc = prod.dtype
    self = self.astype(acc)
    s = self if _is_one(beta) and not _complex(self) else jnp.where(beta == 0, 0, beta.astype(acc) * self)
    return (s + (prod if _is_one(alpha) and not _complex(prod) else alpha.astype(acc) * prod)).astype(out.dtype)


def accumulated(dtype):
    """The dtype a product of ``dtype`` values is summed in on CPU: float32 for half floats."""
    return jnp.float32 if dtype in HALF else dtype


def lerp(a, b, w, parts=None):
    """CPU's kernel: ``|w| < 0.5 ? a + w * (b - a) : b - (b - a) * (1 - w)``, the weight
    converted to the computation dtype first (``1 - w`` computed there, not in float64) and
    bfloat16 / float16 computed in float32, rounded once. With a 0-d weight and operands of one
    shape and dtype (``lerp.Scalar``; the foreach lerp of every Adam step, one per parameter)
    the branch is decided once, in plain ``lax`` ops: jnp's broadcasting ``where`` made the
    foreach lerp a fifth of lowering a GPT training step's graph. ``parts``: a dict the
    weight's 0-d parts are kept in, per dtype, across the calls of one foreach op."""
    dt = a.dtype
    acc = jnp.float32 if dt in HALF else dt
    if (not isinstance(w, jax.Array) or w.ndim or np.dtype(acc).kind != "f" or b.dtype != dt
            or a.shape != b.shape or np.dtype(w.dtype).kind not in "fiub"):  # fmt: skip
        w = w.astype(acc) if hasattr(w, "astype") else w
        a, b = a.astype(acc), b.astype(acc)
        return jnp.where(jnp.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1 - w)).astype(dt)
    p = parts.get(dt) if parts is not None else None
    if p is None:
        ww = w.astype(acc)
        p = (lax.abs(ww) < 0.5, ww, lax.sub(lax.full((), 1, acc), ww))
        if parts is not None:
            parts[dt] = p
    small, ww, omw = p
    a, b = wide(a), wide(b)
    d = lax.sub(b, a)
    return lax.select(small, lax.add(a, lax.mul(ww, d)), lax.sub(b, lax.mul(d, omw))).astype(dt)


def foreach_lerp(xs, ys, w):
    """``_foreach_lerp.Scalar``: ``lerp`` of each pair, the weight's parts made once."""
    parts: dict = {}
    return [lerp(a, b, w, parts) for a, b in zip(xs, ys)]


def sign(out, self):
    """``sign`` / ``sgn``: -1, 0 or 1 (NaN and -0.0 give 0 as in PyTorch); complex ``sgn`` is
    z / |z|, and 0 at 0."""
    if self.dtype == jnp.bool_:
        return self
    if jnp.iscomplexobj(self):
        mag = jnp.abs(self)
        return jnp.where(mag == 0, jnp.zeros((), self.dtype), self / jnp.where(mag == 0, 1, mag).astype(self.dtype))
    return (self > 0).astype(out.dtype) - (self < 0).astype(out.dtype)


def sinc(self):
    """``sinc``: sin(pi x) / (pi x), exactly 1 at 0."""
    p = self * jnp.pi
    return jnp.where(self == 0, jnp.ones_like(self), jnp.sin(p) / p)


def digamma(self):
    """``digamma``: jax's, with PyTorch's value at +-0 (-inf at +0, +inf at -0)."""
    return jnp.where(self == 0, jnp.copysign(jnp.inf, -self), jax.scipy.special.digamma(self))


def _cot_derivative(n):
    # d^n/dy^n cot(y) as a polynomial in c = cot(y): P0 = c, P(k+1) = -(1 + c^2) P(k)'.
    p = np.poly1d([1, 0])
    for _ in range(n):
        p = -np.poly1d([1, 0, 1]) * p.deriv()
    return p.coeffs


def polygamma(n, self):
    """``polygamma(n, x)``: digamma for n == 0; for x < 0 the reflection formula
    psi_n(x) = (-1)^n psi_n(1 - x) - pi^(n+1) cot^(n)(pi x) (jax's zeta is wrong there)."""
    if n == 0:
        return digamma(self)
    neg = self < 0
    y = jnp.where(neg, 1 - self, self)
    base = jnp.where(y == jnp.inf, 0, jax.scipy.special.polygamma(n, y))
    # cot(pi x) = sign(r) tan(pi (1/2 - |r|)) with r = x - round(x) (exact): exactly 0 at half-integers.
    r = self - jnp.round(self)
    cot = jnp.sign(r) * jnp.tan(jnp.pi * (0.5 - jnp.abs(r)))
    refl = (-1) ** n * base - jnp.pi ** (n + 1) * jnp.polyval(_cot_derivative(n), cot)
    pole = (-1) ** (n + 1) * jnp.inf  # at 0, -1, -2, ... (PyTorch's sign)
    return jnp.where(neg | (self == 0), jnp.where(r == 0, pole, refl), base)


def logit(self, eps):
    """``logit``: log(x / (1 - x)), x clamped to [eps, 1 - eps] unless eps is None or < 0."""
    x = self if eps is None else jnp.where(eps < 0, self, jnp.clip(self, eps, 1 - eps))
    return jnp.log(x / (1 - x))


def logit_backward(grad_output, self, eps):
    """``logit_backward``: dy / (x (1 - x)); NaN outside [0, 1] without eps, 0 outside [eps, 1 - eps] with."""
    g = grad_output / (self * (1 - self))
    if eps is None:
        return jnp.where((self < 0) | (self > 1), jnp.nan, g)
    eps = eps.astype(self.dtype)
    return jnp.where(
        eps < 0,
        jnp.where((self < 0) | (self > 1), jnp.nan, g),
        jnp.where((self < eps) | (self > 1 - eps), 0, g),
    )


def round_decimals(self, decimals):
    """``round.decimals``: half-to-even rounding at 10**-decimals, scaling as PyTorch does."""
    if not _is_float(self):
        return self
    if decimals >= 0:
        ten = jnp.asarray(10.0**decimals, self.dtype)
        return jnp.round(self * ten) / ten
    ten = jnp.asarray(10.0**-decimals, self.dtype)
    return jnp.round(self / ten) * ten


def nan_to_num(out, self, nan, posinf, neginf):
    """``nan_to_num``: NaN -> nan (0), +inf -> posinf (dtype max), -inf -> neginf (dtype min)."""
    if not _is_float(self):
        return self
    info = jnp.finfo(self.dtype)
    nan = 0 if nan is None else nan.astype(self.dtype)
    posinf = info.max if posinf is None else posinf.astype(self.dtype)
    neginf = info.min if neginf is None else neginf.astype(self.dtype)
    r = jnp.where(self == jnp.inf, posinf, jnp.where(self == -jnp.inf, neginf, self))
    return jnp.where(jnp.isnan(self), nan, r)


def _bits(x):
    return 1 if x.dtype == jnp.bool_ else jnp.iinfo(x.dtype).bits


def shift_left(self, other):
    """``bitwise_left_shift``: 0 once the shift reaches the width (or is negative)."""
    self, other = jnp.broadcast_arrays(self, other)
    ok = (other >= 0) & (other < _bits(self))
    return jnp.where(ok, lax.shift_left(self, jnp.where(ok, other, 0)), 0)


def shift_right(self, other):
    """``bitwise_right_shift``: arithmetic shift saturating at the width (-1 or 0), as PyTorch."""
    self, other = jnp.broadcast_arrays(self, other)
    n = _bits(self) - 1
    s = jnp.where((other < 0) | (other > n), n, other)
    if jnp.issubdtype(self.dtype, jnp.unsignedinteger):
        return jnp.where((other < 0) | (other > n), 0, lax.shift_right_logical(self, s))
    return lax.shift_right_arithmetic(self, s)


def div(a, b):
    """``a / b`` as CPU's kernels divide: each quotient correctly rounded. XLA's simplifier turns a
    division by a broadcast value (a number, a row's sum) into a multiplication by its reciprocal,
    one rounding more: float32 ``x / 0.3`` differed from CPU in a quarter of elements, ``x /
    x.sum(-1, keepdim=True)`` in a third. A divisor that broadcasts goes to the division through
    an optimization barrier the simplifier does not see through; XLA drops the barrier after
    simplifying, so the broadcast still fuses into the division and nothing is materialized."""
    if not _is_float_like(a) and not _is_float_like(b):
        return a / b
    dt = jnp.result_type(a, b)
    a, b = lax.convert_element_type(a, dt), lax.convert_element_type(b, dt)
    shape = jnp.broadcast_shapes(np.shape(a), np.shape(b))
    if np.shape(b) != shape:
        b = lax.optimization_barrier(jnp.broadcast_to(b, shape))
    if np.shape(a) != shape:
        a = jnp.broadcast_to(a, shape)
    return lax.div(a, b)


def _is_float_like(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return isinstance(x, (float, complex)) if dtype is None else jnp.issubdtype(dtype, jnp.inexact)


def _div_floor_float(a, b):
    # PyTorch's div_floor_floating: exact floor of the true quotient, a / b when b == 0.
    mod = jnp.fmod(a, b)
    q = div(a - mod, b)
    q = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), q - 1, q)
    fl = jnp.floor(q)
    fl = jnp.where(q - fl > 0.5, fl + 1, fl)
    quotient = div(a, b)
    fl = jnp.where(q == 0, jnp.copysign(jnp.zeros_like(q), quotient), fl)
    return jnp.where(b == 0, quotient, fl)


def div_mode(out, self, other, rounding_mode):
    """``div`` with ``rounding_mode`` None (true), 'trunc' or 'floor', for float and integer dtypes."""
    if rounding_mode is None:
        return div(self, other)
    if _is_float(self):
        if rounding_mode == "trunc":  # CPU rounds the quotient to the output dtype first, unless the
            q = div(self, other)  # divisor is one number (0-d): then it truncates float32's quotient
            return jnp.trunc(q if np.ndim(other) == 0 else q.astype(out.dtype))
        return _div_floor_float(self, other)
    self, other = jnp.broadcast_arrays(self, other)
    return lax.div(self, other) if rounding_mode == "trunc" else jnp.floor_divide(self, other)


def power(self, exponent):
    """``pow``. For integers, CPU's: a negative exponent gives 0, or 1 and -1 for bases 1 and -1
    (-1 to an odd power), where XLA's integer power of a negative exponent is undefined (it
    gave 5069619362125685561 for 3 ** -2)."""
    if _is_float(self):  # and complex
        return jnp.power(self, exponent)
    self, exponent = jnp.broadcast_arrays(self, exponent)
    pos = jnp.power(self, jnp.maximum(exponent, 0))
    if self.dtype == jnp.bool_:
        return pos
    one = jnp.ones_like(self)
    minus_one = jnp.where(exponent % 2 == 0, one, -one)  # (-1) ** exponent
    neg = jnp.where(self == 1, one, jnp.where(self == -1, minus_one, jnp.zeros_like(self)))
    return jnp.where(exponent < 0, neg, pos)


def clamp(self, min, max):
    """``clamp.Tensor``: max(self, min) then min(., max); NaN propagates, min > max gives max."""
    if min is not None:
        self = jnp.maximum(self, min)
    if max is not None:
        self = jnp.minimum(self, max)
    return self


def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    """``elu_backward``, from the input or (``is_result``) from the output."""
    x = self_or_result
    neg = alpha * scale
    if is_result:
        g = grad_output * input_scale * (x + neg)
    else:
        g = grad_output * input_scale * neg * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, g, grad_output * scale)


def glu(self, dim):
    """``glu``: first half times the sigmoid of the second half along ``dim``."""
    a, b = jnp.split(self, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


def glu_backward(grad_output, self, dim):
    """``glu_backward``: the gradients of both halves, concatenated along ``dim``."""
    a, b = jnp.split(self, 2, axis=dim)
    s = jax.nn.sigmoid(b)
    return jnp.concatenate([grad_output * s, grad_output * a * s * (1 - s)], axis=dim)


def constant_pad_nd(self, pad, value):
    """``constant_pad_nd``: pairs of (before, after) from the last dim back; negative pads crop."""
    n = len(pad) // 2
    cfg = [(0, 0, 0)] * (self.ndim - n) + [(pad[2 * i], pad[2 * i + 1], 0) for i in reversed(range(n))]
    return lax.pad(self, jnp.asarray(value).astype(self.dtype), cfg)


# --- random ---------------------------------------------------------------------------


def random_int(out, seed, low, high):
    """Integers uniform in [low, high) in ``out``'s dtype (``random_``, ``randint``); ``high``
    None means PyTorch's default top: 2**mantissa digits (inclusive) for floats, the dtype's max."""
    dt = out.dtype
    if high is None:
        if dt == jnp.bool_:
            high = 2
        elif jnp.issubdtype(dt, jnp.inexact):
            high = 2 ** jnp.finfo(dt).nmant * 2 + 1
        else:
            high = int(jnp.iinfo(dt).max) + 1
    # int64 cannot hold 2**63: the top value then has probability 0 instead of 2**-63.
    high = min(high, int(jnp.iinfo(jnp.int64).max))
    return jax.random.randint(rng.key(seed), out.shape, low, high, jnp.int64).astype(dt)


def multinomial(seed, self, num_samples, replacement):
    """``multinomial``: categorical draws with replacement, Gumbel top-k without."""
    key = rng.key(seed)
    logits = jnp.log(self.astype(jnp.promote_types(self.dtype, jnp.float32)))
    if replacement:
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + self.shape[:-1])
        return jnp.moveaxis(draws, 0, -1)
    return lax.top_k(logits + jax.random.gumbel(key, logits.shape, logits.dtype), num_samples)[1]


def cast(self, dtype):
    """``self`` converted to ``dtype`` as CPU PyTorch converts on x86-64: a float to an integer
    truncates toward zero through the processor's conversion to int32 (to int64 for int64),
    which gives its lowest value for NaN and for what is out of its range;
    narrower integers keep the low bits (300.0 -> uint8 is 44, -1.0 -> uint8 is 255, 1e20 ->
    int64 is -2**63). XLA saturates instead (255, 0, 2**63 - 1). Other casts: XLA's."""
    dtype = jnp.dtype(dtype)
    if not (jnp.issubdtype(self.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.integer)):
        return self.astype(dtype)
    wide = jnp.int64 if dtype == jnp.int64 else jnp.int32
    low = jnp.iinfo(wide).min
    t = jnp.trunc(self)
    ok = (t >= low) & (t < -float(low))  # False for NaN
    return jnp.where(ok, jnp.where(ok, t, 0).astype(wide), low).astype(dtype)
