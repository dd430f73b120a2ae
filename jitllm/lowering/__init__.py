"""Lowering of block-kind ONNX graphs to TVM and compilation per target (one module per target).

Only this package imports TVM's compiler (relax); the runtime needs TVM's runtime alone.
"""

APPEND_FUNCTION = "kv_append"
"""Name of the KV append kernel compiled beside each decoder block's `main`."""
EXPORT_PAGES = "export_pages"
IMPORT_PAGES = "import_pages"
"""Page copy kernels compiled beside each decoder block (migration moves KV pages with them)."""
EMBED_FUNCTION = "embed"
"""Embedding row gather compiled beside a GPU head's `main`: a tied head's weights are the embedding table,
so a prompt's rows are gathered on the device that holds them."""
ARGMAX_FUNCTION = "argmax"
"""The greedy pick compiled beside a GPU head's decode `main`: the device finds the largest logit, so a greedy
step brings back one token instead of the vocabulary's logits."""
KERNEL_PACKAGE_FORMAT = 2
"""The layout version of a kernel package (lowering/kernel_package.py writes it, runtime/backends/wgpu.py reads it;
2: a host function's steps may make scratch buffers)."""
