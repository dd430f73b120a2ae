"""TIR kernels of jitllm's custom ops, one folder per hardware family (a target declares the folders its
artifacts are generated from: their sources are part of the cache key)."""

from jitllm.lowering.kernels import macro_lookup

macro_lookup.install()
