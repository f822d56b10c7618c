"""torch_xla's ``_internal`` helpers that its tests and launchers import (``pjrt``, ``tpu``)."""
