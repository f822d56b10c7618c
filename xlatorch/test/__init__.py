"""``torch_xla.test``: helpers for tests and example scripts."""
