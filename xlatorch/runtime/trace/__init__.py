"""The runtime's trace stage (see README.md)."""
