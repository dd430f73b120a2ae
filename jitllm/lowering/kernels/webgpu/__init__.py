"""WGSL-friendly kernels (the webgpu target): WGSL has no 8-bit or 64-bit integers, so quantized weights are
read as 32-bit words (four rows of a row group's bytes each) and every index is int32. The SIMT kernels
that need neither (paged attention, KV append, page export/import) are the CUDA ones, kernels/cuda/basic.py
and kernels/cuda/pages.py, shared."""
