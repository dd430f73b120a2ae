"""A small helper over onnx.helper that names intermediate values and collects nodes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
DOMAIN = "jitllm"

DTYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "int8": TensorProto.INT8,
    "uint8": TensorProto.UINT8,
    "uint16": TensorProto.UINT16,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
}


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
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value, dtype: str = "int64") -> str:
        name = self.fresh("const")
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype), name)
        self.nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        return name

    def rename(self, value: str, name: str) -> None:
        """Expose `value` under a fixed name (a graph output)."""
        self.nodes.append(helper.make_node("Identity", [value], [name]))


def tensor_info(name: str, dtype: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, DTYPES[dtype], list(shape))
