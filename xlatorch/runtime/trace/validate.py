"""CPU's errors decided from shapes and dtypes alone, which PyTorch's meta kernels skip.

The device takes every op's result shape and dtype from PyTorch's meta kernels, and some of
them accept what CPU's kernel refuses: ``x[idx] = long_values`` into a float ``x`` (CPU:
"Index put requires the source and destination dtypes match"), an ``index_add_`` source of
another shape. An ``ops.yaml`` entry's ``validate`` expression calls these with the op's
arguments as meta tensors and Python values when its signature is first seen
(``nodes._infer``): CPU's exception and message are raised at the call, and a signature seen
before costs nothing. Conditions on the data (an index's values, a mask's count) are on-device
checks (``lowering/checks.py``).
"""

from __future__ import annotations

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from xlatorch.runtime.trace.dynamic import _is_mask
from xlatorch.runtime.trace.nodes import dtype_name

__all__ = [
    "index_put", "index_copy", "index_add", "put", "mm", "addmm", "addmv", "norm_params", "convolution",
    "scatter_reduce", "index_reduce", "clamp_tensor", "spaced", "polygamma", "normal_std", "random_bounds", "bucketize",
    "as_strided_scatter", "out_bool", "out_exact", "out_scalar_type", "bucketize_out", "normal_out", "attention",
]  # fmt: skip

aten = torch.ops.aten


def _broadcasts(shape, to) -> bool:
    """Whether a tensor of ``shape`` expands to ``to`` (CPU's ``expand``: no new leading dims)."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(to)))


def index_put(self, indices, values):
    """``x[idx] = v`` / ``index_put_``, in CPU's order: the values broadcast to the indexing
    result (a lone boolean mask's count is data: checked on the device), then the dtypes match."""
    if not any(_is_mask(t) for t in indices):
        try:
            shape = aten.index.Tensor(self, indices).shape
        except (RuntimeError, IndexError):  # bad indices: the meta kernel raises CPU's error
            shape = None
        if shape is not None and not _broadcasts(values.shape, shape):
            raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                               f"indexing result of shape {list(shape)}")  # fmt: skip
    if values.dtype != self.dtype:
        raise RuntimeError(f"Index put requires the source and destination dtypes match, got {dtype_name(self.dtype)} "
                           f"for the destination and {dtype_name(values.dtype)} for the source.")  # fmt: skip


def index_copy(self, source):
    """``index_copy_``: the dtypes match (checked before the slice shapes, as on CPU)."""
    if source.dtype != self.dtype:
        raise RuntimeError(f"index_copy_(): self and source expected to have the same dtype, but got (self) "
                           f"{dtype_name(self.dtype)} and (source) {dtype_name(source.dtype)}")  # fmt: skip


def index_add(self, dim: int, index, source):
    """``index_add_``: the dtypes match; ``source`` has ``self``'s shape outside ``dim`` (the meta
    kernel broadcasts it)."""
    if source.dtype != self.dtype:
        raise RuntimeError(f"index_add_(): self ({dtype_name(self.dtype)}) and source ({dtype_name(source.dtype)}) "
                           f"must have the same scalar type")  # fmt: skip
    if index.dim() > 1 or index.numel() != (source.shape[dim] if -source.dim() <= dim < source.dim() else 1):
        return  # the meta kernel raises CPU's error ("Number of indices (2) should be equal to source.size(dim)")
    want, got = list(self.shape), list(source.shape)
    if want and got:  # CPU compares the shapes without dim, unless one is 0-d
        d = dim % len(want)
        if d >= len(got):
            return
        del want[d], got[d]
    if want != got:
        raise RuntimeError(f"source tensor shape must match self tensor shape, excluding the specified dimension. "
                           f"Got self.shape = {list(self.shape)} source.shape = {list(source.shape)}")  # fmt: skip


def put(self, index, source):
    """``put_``: the dtypes match, then ``source`` has as many elements as ``index``."""
    if source.dtype != self.dtype:
        raise RuntimeError(f"put_(): self and source expected to have the same dtype, but got self.dtype = "
                           f"{dtype_name(self.dtype)} and source.dtype = {dtype_name(source.dtype)}")  # fmt: skip
    if source.numel() != index.numel():
        raise IndexError(f"put_(): Expected source and index to have the same number of elements, but got "
                         f"source.numel() = {source.numel()}, index.numel() = {index.numel()}")  # fmt: skip


def scatter_reduce(self, reduce: str):
    """``scatter_reduce``: CPU's kernels have no complex amax / amin and no bool mean."""
    refused = {"amax": (torch.complex64, torch.complex128), "amin": (torch.complex64, torch.complex128),
               "mean": (torch.bool,)}.get(reduce, ())  # fmt: skip
    if self.dtype in refused:
        raise NotImplementedError(f'"scatter_gather_tensor_cpu_reduce_{reduce}" not implemented for '
                                  f"'{dtype_name(self.dtype)}'")  # fmt: skip


def index_reduce(self, reduce: str, include_self: bool):
    """``index_reduce``: CPU's kernels for bool and complex tensors, as it picks them. Without
    ``self``'s values, or for a ``self`` of at most one dimension, it has none; otherwise it
    reduces slice by slice, with no bool mean (its division) and no complex amax / amin (their
    maximum and minimum)."""
    dt = self.dtype
    if dt not in (torch.bool, torch.complex64, torch.complex128):
        return
    if not include_self:
        kernel = "index_reduce_func_exclude_input_init"
    elif self.dim() <= 1:
        kernel = "index_func_"
    else:
        kernel = {"mean": "div_floor_cpu"} if dt is torch.bool else {"amax": "maximum_cpu", "amin": "minimum_cpu"}
        kernel = kernel.get(reduce)
    if kernel is not None:
        raise NotImplementedError(f"\"{kernel}\" not implemented for '{dtype_name(dt)}'")


def clamp_tensor(self, min, max):
    """``clamp`` with tensor bounds: no complex kernel, and a bool one only for a single bound
    (CPU clamps by ``maximum`` / ``minimum`` then), in the dtype the three promote to."""
    tensors = [t for t in (self, min, max) if t is not None]
    dt = elementwise_dtypes(*tensors, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]
    if dt.is_complex:
        raise NotImplementedError("clamp is not supported for complex types")
    if dt is torch.bool and min is not None and max is not None:
        raise NotImplementedError("\"clamp_cpu\" not implemented for 'Bool'")


def spaced(steps: int, dtype, kernel: str) -> None:
    """``linspace`` / ``logspace``: no bool kernel, which CPU runs only for two steps or more
    (one step is filled with ``start``)."""
    if steps > 1 and dtype is torch.bool:
        raise NotImplementedError(f"\"{kernel}\" not implemented for 'Bool'")


def polygamma(n: int, self):
    """``polygamma``: no complex kernel, named by CPU after the ``n`` it runs."""
    if self.dtype.is_complex:
        kernel = {0: "digamma", 1: "trigamma"}.get(n, "polygamma")
        raise NotImplementedError(f"\"{kernel}\" not implemented for '{dtype_name(self.dtype)}'")


def normal_std(std):
    """``normal``'s standard deviation: real."""
    if std.dtype.is_complex:
        raise RuntimeError("normal expects standard deviation to be non-complex")


def random_bounds(dtype, low, high):
    """``randint`` / ``randint_like``: ``low < high``, both within an integer or bool ``dtype``
    (the device would draw values the dtype cannot hold); no complex dtype."""
    dtype = dtype or torch.int64
    if dtype.is_complex:
        raise RuntimeError("check_random_bounds handles only integral, floating-point and boolean types")
    if low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    if dtype.is_floating_point:
        return
    info = (0, 1) if dtype is torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    for name, v in (("from", low), ("to - 1", high - 1)):
        if not info[0] <= v <= info[1]:
            raise RuntimeError(f"{name} is out of bounds for {_cpp_name(dtype)}")


def bucketize(boundaries):
    """``bucketize``: 1-d boundaries."""
    if boundaries.dim() != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.dim()})")


def as_strided_scatter(self, size, stride, storage_offset):
    """``as_strided_scatter``: the view it writes lies within ``self``'s (contiguous) storage."""
    offset = storage_offset or 0
    item = self.element_size()
    need = 0 if 0 in size else item * (offset + 1 + sum((n - 1) * s for n, s in zip(size, stride)))
    if need > self.numel() * item:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
                           f"itemsize {item} requiring a storage size of {need} are out of bounds for storage of "
                           f"size {self.numel() * item}")  # fmt: skip


def out_bool(name: str, outs):
    """``all`` / ``any``: a bool (or uint8) out= tensor."""
    for dt in outs:
        if dt not in (torch.bool, torch.uint8):
            raise RuntimeError(f"{name} only supports bool tensor for result, got: {dtype_name(dt)}")


def out_exact(outs, results):
    """An out= tensor of exactly the result's dtype (``isin``, ``aminmax``)."""
    for dt, want in zip(outs, results):
        if dt != want:
            raise RuntimeError(f"Expected out tensor to have dtype {_cpp_name(want)}, but got {_cpp_name(dt)} instead")


def out_scalar_type(outs, results):
    """An out= tensor of exactly the result's dtype, in the kernels' words (``solve_triangular``)."""
    for dt, want in zip(outs, results):
        if dt != want:
            raise RuntimeError(f"expected scalar type {dtype_name(want)} but found {dtype_name(dt)}")


def bucketize_out(outs, out_int32: bool):
    """``bucketize`` / ``searchsorted``: int32 out= with ``out_int32``, else int64."""
    if outs[0] != (torch.int32 if out_int32 else torch.int64):
        raise RuntimeError("torch.searchsorted(): output tensor's dtype is wrong, it can only be Int(int32) or "
                           "Long(int64) depending on whether out_int32 flag is True, but we got output tensor's "
                           f"dtype {dtype_name(outs[0])} and out_int32 flag is {out_int32}")  # fmt: skip


def multinomial(self, num_samples: int, replacement: bool):
    """``multinomial``: CPU's checks of the arguments, in its order (the values are checked on
    the device: ``L.checks.multinomial``)."""
    if self.dim() not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not self.is_floating_point():
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {dtype_name(self.dtype)}")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if self.shape[-1] > 1 << 24:
        raise RuntimeError("number of categories cannot exceed 2^24")


def multinomial_out(outs):
    """``multinomial``: an int64 out= tensor only (CPU does not cast its samples)."""
    if outs[0] != torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {dtype_name(outs[0])}")


def normal_out(outs):
    """``normal``'s CPU kernel fills floating and complex tensors only."""
    if not (outs[0].is_floating_point or outs[0].is_complex):
        raise NotImplementedError(f"\"normal_kernel_cpu\" not implemented for '{dtype_name(outs[0])}'")


def _cpp_name(dtype: torch.dtype) -> str:
    """The C++ name of ``dtype`` as CPU's matmul messages print it ("float", "long int")."""
    return _CPP.get(dtype) or dtype_name(dtype)


_CPP = {
    torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
    torch.int64: "long int", torch.int32: "int", torch.int16: "short int", torch.int8: "signed char",
    torch.uint8: "unsigned char", torch.bool: "bool", torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}  # fmt: skip


def mm(self, mat2):
    """``mm`` (and ``matmul`` / ``linear`` reaching it): both matrices of one dtype."""
    if self.dtype != mat2.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {_cpp_name(self.dtype)} != "
                           f"{_cpp_name(mat2.dtype)}")  # fmt: skip


def addmm(self, mat1, mat2):
    """``addmm`` (``linear`` with a bias): the matrices, then ``self``, of one dtype."""
    for name, t in (("mat1", mat1), ("self", self)):
        if t.dtype != mat2.dtype:
            raise RuntimeError(f"{name} and mat2 must have the same dtype, but got {dtype_name(t.dtype)} and "
                               f"{dtype_name(mat2.dtype)}")  # fmt: skip


def addmv(self, mat, vec):
    """``addmv`` / ``mv`` (whose result, ``self`` here, takes ``vec``'s dtype): one dtype."""
    if not self.dtype == mat.dtype == vec.dtype:
        raise RuntimeError(f"addmv input tensors must have the same dtype, but got {dtype_name(self.dtype)}, "
                           f"{dtype_name(mat.dtype)}, and {dtype_name(vec.dtype)}")  # fmt: skip


def norm_params(input, *params):
    """``layer_norm`` / ``group_norm`` / ``batch_norm``'s weight, bias and running stats, as CPU's
    kernels take them: of ``input``'s dtype, or (a "mixed" call, told by the first given) all
    float32 beside a bfloat16 or float16 ``input``."""
    given = [p for p in params if p is not None]
    if not given:
        return
    if given[0].dtype == input.dtype:
        for p in given:
            if p.dtype != input.dtype:
                raise RuntimeError(f"expected scalar type {dtype_name(input.dtype)} but found {dtype_name(p.dtype)}")
        return
    if any(p.dtype != torch.float32 for p in given):
        raise RuntimeError("mixed dtype (CPU): expect parameter to have scalar type of Float")
    if input.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError("mixed dtype (CPU): all inputs must share same datatype.")


def _dims(names, values) -> str:
    return " ".join(f"{n}: {v}" for n, v in zip(names, values))


def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``convolution``: CPU's checks of its parameters and shapes (``_convolution`` and its
    kernels), in CPU's order; the meta kernel takes a negative padding, a mismatched dtype,
    an output padding as large as the stride."""
    k = weight.dim()
    n = k - 2
    if n <= 0:
        raise RuntimeError("weight should have at least three dimensions")
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    params = {}
    given = {"stride": stride, "padding": padding, "dilation": dilation, "output_padding": output_padding}
    for name, v in given.items():
        v = list(v)
        if len(v) not in (1, n):
            raise RuntimeError(f"expected {name} to be a single integer value or a list of {n} values to match the "
                               f"convolution dimensions, but got {name}={v}")  # fmt: skip
        params[name] = v * n if len(v) == 1 else v
    stride, padding, dilation, output_padding = params.values()
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(p < 0 for p in output_padding):
        raise RuntimeError("negative output_padding is not supported")
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(d < 0 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")
    ws = list(weight.shape)
    if input.dim() != k:
        raise RuntimeError(f"Expected {k}-dimensional input for {k}-dimensional weight {ws}, but got "
                           f"{input.dim()}-dimensional input of size {list(input.shape)} instead")  # fmt: skip
    if ws[0] < groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be at least {groups} at dimension 0, but got "
                           f"weight of size {ws} instead")  # fmt: skip
    if ws[0] % groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} at dimension 0, but "
                           f"got weight of size [{ws}] instead")  # fmt: skip
    # the kernels' own check, after the shapes'
    _conv_dtype = input.dtype != weight.dtype and (
        f"expected scalar type {dtype_name(input.dtype)} but found {dtype_name(weight.dtype)}"
    )
    if transposed:
        channels, outs = ws[0], ws[1] * groups
        if input.shape[1] != channels:
            raise RuntimeError(f"Given transposed=1, weight of size {ws}, expected input{list(input.shape)} to have "
                               f"{channels} channels, but got {input.shape[1]} channels instead")  # fmt: skip
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != outs):
            raise RuntimeError(f"Given transposed=1, weight of size {ws}, expected bias to be 1-dimensional with "
                               f"{outs} elements, but got bias of size {list(bias.shape)} instead")  # fmt: skip
        # CPU's kernels view a 1-d convolution as a 2-d one of height 1
        names = ("depth", "height", "width")[-n:] if n > 1 else ("height", "width")
        lift = (lambda v, one: [one, *v]) if n == 1 else (lambda v, one: v)
        if 0 in dilation:
            raise RuntimeError("dilation should be greater than zero, but got "
                               + ", ".join(f"dilation_{x}: {v}" for x, v in zip(names, lift(dilation, 1))))  # fmt: skip
        _conv_kernel(input, n, dilation, transposed)
        if _conv_dtype:
            raise RuntimeError(_conv_dtype)
        if any(o >= s and o >= d for o, s, d in zip(output_padding, stride, dilation)):
            raise RuntimeError("output padding must be smaller than either stride or dilation, but got "
                               + " ".join([_dims([f"output_padding_{x}" for x in names], lift(output_padding, 0)),
                                           _dims([f"stride_{x}" for x in names], lift(stride, 1)),
                                           _dims([f"dilation_{x}" for x in names], lift(dilation, 1))]))  # fmt: skip
        return
    if input.shape[1] != ws[1] * groups:
        raise RuntimeError(f"Given groups={groups}, weight of size {ws}, expected input{list(input.shape)} to have "
                           f"{ws[1] * groups} channels, but got {input.shape[1]} channels instead")  # fmt: skip
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != ws[0]):
        raise RuntimeError(f"Given weight of size {ws}, expected bias to be 1-dimensional with {ws[0]} elements, "
                           f"but got bias of size {list(bias.shape)} instead")  # fmt: skip
    padded = [input.shape[i + 2] + 2 * padding[i] for i in range(n)]
    kernel = [dilation[i] * (ws[i + 2] - 1) + 1 for i in range(n)]
    if any(p < q for p, q in zip(padded, kernel)):
        raise RuntimeError(f"Calculated padded input size per channel: ({' x '.join(map(str, padded))}). "
                           f"Kernel size: ({' x '.join(map(str, kernel))}). "
                           f"Kernel size can't be greater than actual input size")  # fmt: skip
    if 0 in dilation:
        raise RuntimeError(f"dilation should be greater than zero, but got {[1, *dilation] if n == 1 else dilation}")
    _conv_kernel(input, n, dilation, transposed)
    if _conv_dtype:
        raise RuntimeError(_conv_dtype)


# CPU's convolution kernels for a dtype mkldnn does not take (integers, bool, complex), as
# ``_select_conv_backend`` picks them (a 1-d convolution runs as a 2-d one): each kernel's name
# in its error, and the dtypes it has no implementation for. Probed on CPU: a dilated or
# transposed convolution of int32 raises, an undilated one computes it.
_SMALL_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32)
_NO_KERNEL = (torch.bool, torch.complex64, torch.complex128)


def _conv_kernel(input, n: int, dilation, transposed: bool) -> None:
    """Raise CPU's error where the kernel CPU runs this convolution with has no implementation
    for the input's dtype. An input with no elements runs no kernel."""
    if input.numel() == 0:
        return
    if transposed:
        name, refused = f"slow_conv_transpose{3 if n == 3 else 2}d_out_cpu", _NO_KERNEL + _SMALL_INTS
    elif any(d != 1 for d in dilation):
        name, refused = "slow_conv_dilated<>", _NO_KERNEL + _SMALL_INTS
    else:
        name, refused = "compute_columns3d" if n == 3 else "slow_conv2d_cpu", _NO_KERNEL
    if input.dtype in refused:
        raise NotImplementedError(f"\"{name}\" not implemented for '{dtype_name(input.dtype)}'")


def attention(query, key, value, embed_dim: int, num_heads: int, qkv_weight, qkv_bias, mask, mask_type) -> None:
    """CPU's checks of the Transformer fast path's attention (``_native_multi_head_attention``,
    ``_transformer_encoder_layer_fwd``), in its order, the masked softmax's last (PyTorch's meta
    kernels make none)."""
    c = torch._check
    c(query.dim() == 3, lambda: f"expected 3-D `query`, got {query.dim()}-D tensor")
    c(
        query.shape[2] == embed_dim,
        lambda: f"passed-in embed_dim {embed_dim} didn't match last dim of query {query.shape[2]}",
    )
    c(key.dim() == 3, lambda: f"expected 3-D `key`, got {key.dim()}-D tensor")
    c(value.dim() == 3, lambda: f"expected 3-D `value`, got {value.dim()}-D tensor")
    c(query.shape == key.shape == value.shape, lambda: "expected `query`/`key`/`value` shapes to match")
    c(qkv_weight.dim() == 2, lambda: f"expected 2-D `qkv_weight`, got {qkv_weight.dim()}-D tensor")
    c(embed_dim * 3 == qkv_weight.shape[0], lambda: "expected `qkv_weight` first dim to be 3x embed_dim")
    c(embed_dim == qkv_weight.shape[1], lambda: "expected `qkv_weight` second dim to be embed_Dim")
    c(qkv_bias.dim() == 1, lambda: f"expected 1-D `qkv_bias`, got {qkv_bias.dim()}-D tensor")
    c(qkv_bias.shape[0] == 3 * embed_dim, lambda: "expected `qkv_bias` first dim and first dim of query to be equal")
    c(embed_dim % num_heads == 0, lambda: "`embed_dim` must divide evenly by `num_heads`")
    if mask is not None:  # the masked softmax's own checks, on the scores' shape
        scores = query.new_empty((query.shape[0], num_heads, query.shape[1], query.shape[1]))
        aten._masked_softmax.default(scores, mask.bool(), 3, mask_type)
