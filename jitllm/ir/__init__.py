"""Model config -> per-block-kind ONNX graphs (weights are graph inputs)."""
