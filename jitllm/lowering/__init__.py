"""Lowering of block-kind ONNX graphs to TVM and compilation per target (one module per target)."""
