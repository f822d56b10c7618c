"""The runtime's plan stage (see README.md)."""
