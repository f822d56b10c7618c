"""ops.yaml + ATen schemas (via torchgen) -> generated/ (dispatch shims and emitters)."""
