"""The core part: what every layer may import (errors, the .jlm file, weight layouts and quant tables,
paths, atomic writes). It imports nothing else of jitllm (docs/architecture.md; tests/test_architecture.py)."""
