"""CUDA kernels (the cuda target): matvecs and tensor-core GEMMs over the weight layouts, split decode
attention, tensor-core prefill attention, rotary, embedding gather, greedy pick, page export/import."""
