"""Names of the environment variables xlatorch reads (``torch_xla.core.xla_env_vars``).

Each constant's value is the variable's name, as in torch_xla; the README says what each does.
"""

PJRT_DEVICE = "PJRT_DEVICE"  # CPU / GPU / TPU: the platform behind the xla device
XLA_USE_BF16 = "XLA_USE_BF16"  # float32 and float64 stored as bfloat16
XLA_DOWNCAST_BF16 = "XLA_DOWNCAST_BF16"  # float32 as bfloat16, float64 as float32
LTC_USE_BF16 = "LTC_USE_BF16"
LTC_DOWNCAST_BF16 = "LTC_DOWNCAST_BF16"
XLA_METRICS_FILE = "XLA_METRICS_FILE"  # append the metrics report to this file at every step
XLA_IR_DEBUG = "XLA_IR_DEBUG"  # record the user's source line of each IR node
XLA_HLO_DEBUG = "XLA_HLO_DEBUG"  # name each HLO op after its ATen op and source line
PT_XLA_DEBUG = "PT_XLA_DEBUG"  # the debug knob (XLATORCH_DEBUG levels)
PT_XLA_DEBUG_LEVEL = "PT_XLA_DEBUG_LEVEL"
