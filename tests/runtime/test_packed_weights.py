"""A unit's weights in one allocation: tensors are aliases TVM's kernels accept, moved in one copy."""

from __future__ import annotations

import numpy as np
import tvm

from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.backends.host import host_device
from jitllm.runtime.engine.packed_weights import ALIGN, PackedWeights


def _groups(rng):
    stacked = [rng.standard_normal((rows, 3, 8)).astype(np.float16) for rows in (4, 1, 2)]
    return [stacked, [rng.standard_normal(5).astype(np.float32)], [rng.integers(0, 255, (3, 7), dtype=np.uint8)]]


def test_upload_stacks_each_group_into_one_allocation():
    groups = _groups(np.random.default_rng(0))
    packed = PackedWeights.upload(host_device(), groups)
    assert len(packed) == 3
    for tensor, parts in zip(packed, groups):
        assert np.array_equal(tensor.numpy(), np.concatenate(parts))
    base = packed.buffer.data_ptr()
    for tensor, (_, _, offset) in zip(packed, packed.layout):
        assert tensor.data_ptr() == base + offset and offset % ALIGN == 0
        assert np.from_dlpack(tensor).__array_interface__["data"][0] == base + offset


def test_aliases_run_in_kernels_and_move_in_one_copy():
    """TVM's compiled kernels reject a tensor with a byte offset; the aliases carry none."""
    packed = PackedWeights.upload(host_device(), _groups(np.random.default_rng(1)))
    x = tvm.te.placeholder((5,), "float32", name="x")
    y = tvm.te.compute((5,), lambda i: x[i] * 2.0, name="y")
    double = tvm.compile(tvm.te.create_prim_func([x, y]), target="llvm")
    out = tvm.runtime.empty((5,), "float32", tvm.cpu())
    double(packed[1], out)
    assert np.array_equal(out.numpy(), packed[1].numpy() * 2)

    moved = packed.to(simulated_device("sim"))
    assert moved.buffer.data_ptr() != packed.buffer.data_ptr() and moved.layout == packed.layout
    for a, b in zip(moved, packed):
        assert np.array_equal(a.numpy(), b.numpy())
    del packed  # the moved copy owns its memory
    assert np.array_equal(moved[0].numpy()[:4], _groups(np.random.default_rng(1))[0][0])
