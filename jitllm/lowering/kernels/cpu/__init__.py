"""Host CPU kernels (the llvm target): linears over the weight layouts, paged attention, the KV append,
page export/import and the gated recurrence."""
