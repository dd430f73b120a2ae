"""A small helper over onnx.helper that names intermediate values and collects nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

OPSET = 18
DOMAIN = "jitllm"

DTYPES = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int32": 6, "int64": 7, "float16": 10}
"""Element type -> ONNX's TensorProto.DataType number (fixed by the ONNX spec; written out so that the
IR's modules import onnx only when a graph is built: a warm start never builds one, docs/performance.md)."""
F32 = DTYPES["float32"]


class GraphBuilder:
    """Accumulates nodes; `op(...)` returns the name of the (first) output."""

    def __init__(self, prefix: str = "") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0
        self._prefix = prefix

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self._prefix}{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs) -> str | list[str]:
        from onnx import helper

        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value, dtype: str = "int64") -> str:
        from onnx import helper, numpy_helper

        name = self.fresh("const")
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype), name)
        self.nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        return name

    def rename(self, value: str, name: str) -> None:
        """Expose `value` under a fixed name (a graph output)."""
        from onnx import helper

        self.nodes.append(helper.make_node("Identity", [value], [name]))


def tensor_info(name: str, dtype: str, shape) -> onnx.ValueInfoProto:
    from onnx import helper

    return helper.make_tensor_value_info(name, DTYPES[dtype], list(shape))
