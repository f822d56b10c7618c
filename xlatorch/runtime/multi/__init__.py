"""The runtime's multi stage (see README.md)."""
