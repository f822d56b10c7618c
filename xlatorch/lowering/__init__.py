"""Hand-written lowering helpers that ops.yaml entries name with ``helper:``.

One module per op family. A helper takes ``out`` (the output aval(s)) and the
ATen schema's arguments in order, and returns JAX values.
"""

from xlatorch.lowering import (  # noqa: F401
    amp,
    antialias,
    checks,
    distributions,
    factory,
    fft,
    index,
    linalg,
    linalg_more,
    loss,
    nn,
    norm,
    optim,
    pointwise,
    pool,
    pool_fractional,
    reduce,
    rng,
    rnn,
    sample,
    segment,
    shape,
    sort,
    special,
    transformer,
)
