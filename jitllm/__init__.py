"""jitllm: an LLM inference engine that places transformer blocks on devices and compiles them with TVM."""

__version__ = "0.1.0"
