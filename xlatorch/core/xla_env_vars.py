"""Names of environment variables (``torch_xla.core.xla_env_vars``).

Each constant's value is the variable's name, exactly as torch_xla spells it (note
``TPU_MESH_CTLER_ADDR`` names ``TPU_MESH_CONTROLLER_ADDRESS``). The first block is the one
torch_xla defines; the second holds the variables xlatorch reads that torch_xla documents
elsewhere. The TPU_* names describe a TPU slice's topology: xlatorch reads none of them off
TPU, where JAX's TPU runtime reads them itself.
"""

# torch_xla's names.
TPUVM_MODE = "TPUVM_MODE"
TPU_NUM_DEVICES = "TPU_NUM_DEVICES"
CPU_NUM_DEVICES = "CPU_NUM_DEVICES"  # devices of the CPU platform (xr.global_runtime_device_count)
CLOUD_TPU_TASK_ID = "CLOUD_TPU_TASK_ID"  # this host's index in a TPU slice
ACCELERATOR_TYPE = "ACCELERATOR_TYPE"
WORKER_ID = "WORKER_ID"
TPU_SKIP_MDS_QUERY = "TPU_SKIP_MDS_QUERY"  # do not ask the GCE metadata server for the topology
TPU_ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"  # e.g. v4-8
TPU_WORKER_ID = "TPU_WORKER_ID"
TPU_WORKER_HOSTNAMES = "TPU_WORKER_HOSTNAMES"
TPU_HOST_BOUNDS = "TPU_HOST_BOUNDS"
TPU_CHIPS_PER_HOST_BOUNDS = "TPU_CHIPS_PER_HOST_BOUNDS"
TPU_MESH_CTLER_ADDR = "TPU_MESH_CONTROLLER_ADDRESS"
TPU_MESH_CTLER_PORT = "TPU_MESH_CONTROLLER_PORT"
PJRT_DEVICE = "PJRT_DEVICE"  # CPU / GPU / TPU: the platform behind the xla device
PJRT_SELECT_DEFAULT_DEVICE = "PJRT_SELECT_DEFAULT_DEVICE"
PJRT_LOCAL_PROCESS_RANK = "PJRT_LOCAL_PROCESS_RANK"
PJRT_LOCAL_PROCESS_COUNT = "PJRT_LOCAL_PROCESS_COUNT"
PJRT_DYNAMIC_PLUGINS = "PJRT_DYNAMIC_PLUGINS"
TPU_CHIPS_PER_PROCESS_BOUNDS = "TPU_CHIPS_PER_PROCESS_BOUNDS"  # chips one process drives, "x,y,z"
TPU_PROCESS_BOUNDS = "TPU_PROCESS_BOUNDS"  # the grid of processes in a slice, "x,y,z"
TPU_PROCESS_ADDRESSES = "TPU_PROCESS_ADDRESSES"  # host:port of every process, comma-separated
TPU_VISIBLE_CHIPS = "TPU_VISIBLE_CHIPS"  # the chips this process may use, comma-separated
TPU_PROCESS_PORT = "TPU_PROCESS_PORT"  # this process's port in TPU_PROCESS_ADDRESSES
PJRT_CPU_ASYNC_CLIENT = "PJRT_CPU_ASYNC_CLIENT"
PJRT_DIST_SERVICE_ADDR = "PJRT_DIST_SERVICE_ADDR"
LOCAL_RANK = "LOCAL_RANK"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

# xlatorch reads these too.
XLA_USE_BF16 = "XLA_USE_BF16"  # float32 and float64 stored as bfloat16
XLA_DOWNCAST_BF16 = "XLA_DOWNCAST_BF16"  # float32 as bfloat16, float64 as float32
LTC_USE_BF16 = "LTC_USE_BF16"
LTC_DOWNCAST_BF16 = "LTC_DOWNCAST_BF16"
XLA_METRICS_FILE = "XLA_METRICS_FILE"  # append the metrics report to this file at every step
XLA_IR_DEBUG = "XLA_IR_DEBUG"  # record the user's source line of each IR node
XLA_HLO_DEBUG = "XLA_HLO_DEBUG"  # name each HLO op after its ATen op and source line
PT_XLA_DEBUG = "PT_XLA_DEBUG"  # the debug knob (XLATORCH_DEBUG levels)
PT_XLA_DEBUG_LEVEL = "PT_XLA_DEBUG_LEVEL"
