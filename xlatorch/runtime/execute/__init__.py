"""The runtime's execute stage (see README.md)."""
