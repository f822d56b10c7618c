"""The runtime's lower stage (see README.md)."""
