"""The runtime's base stage (see README.md)."""
