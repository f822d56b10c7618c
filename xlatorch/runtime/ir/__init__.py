"""The runtime's ir stage (see README.md)."""
