"""The autocast policy on the device: one table from ATen overload to cast class.

PyTorch/XLA's policy (its ``AutocastXLA`` kernels), widened with the float32 list PyTorch
uses for CUDA so that norms, softmax, reductions, losses and exp/log-like pointwise ops
keep float32 accuracy:

- ``LOW``: matmuls, convolutions, linear, attention (and ``relu`` / ``max_pool2d``, as
  PyTorch/XLA does) run in the autocast dtype (bfloat16 by default on the device): every
  float32 device tensor argument is cast down.
- ``FP32``: numerically sensitive ops run in float32: every float16/bfloat16 device tensor
  argument is cast up.
- ``PROMOTE``: ops mixing several inputs run in the widest floating type among them
  (``cat`` of a bfloat16 and a float32 tensor gives float32), as on CPU and CUDA.

float64 tensors, integer tensors and CPU tensors are never cast (as in PyTorch). Ops not in
the table run in whatever dtypes they are given.
"""

from __future__ import annotations

LOW, FP32, PROMOTE = "low", "fp32", "promote"

# "op.overload" ("op" for the default overload), one family a line, by cast class.
_TABLE = {
    LOW: """
        mm bmm addmm addbmm baddbmm addmv addr mv matmul linear einsum linalg_vecdot chain_matmul linalg_multi_dot
        conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding conv_tbc convolution _convolution
        conv_transpose1d conv_transpose2d.input conv_transpose3d.input
        scaled_dot_product_attention prelu relu max_pool2d
    """,
    FP32: """
        softmax.int log_softmax.int logsumexp
        layer_norm native_layer_norm group_norm batch_norm instance_norm rms_norm
        norm.Scalar norm.ScalarOpt_dim frobenius_norm.dim nuclear_norm linalg_vector_norm cosine_similarity renorm
        sum sum.dim_IntList prod prod.dim_int cumsum cumprod dist pdist cdist trace
        binary_cross_entropy binary_cross_entropy_with_logits cross_entropy_loss nll_loss nll_loss2d
        mse_loss l1_loss smooth_l1_loss huber_loss kl_div poisson_nll_loss cosine_embedding_loss
        hinge_embedding_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
        multi_margin_loss ctc_loss.IntList ctc_loss.Tensor
        exp expm1 log log10 log2 log1p pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar reciprocal rsqrt
        acos asin cosh sinh tan erfinv softplus
    """,
    PROMOTE: """
        cat stack index_copy addcdiv addcmul atan2 bilinear cross dot vdot tensordot index_put scatter_add
    """,
}
POLICY: dict[str, str] = {op: cls for cls, ops in _TABLE.items() for op in ops.split()}
