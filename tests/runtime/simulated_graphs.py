"""The tiny model over two simulated devices that record their decode steps with ReplayRecorder (the host's
stand-in for CUDA graphs): shared by the captured-step and pipelined-decode tests."""

from __future__ import annotations

from jitllm.model import load
from jitllm.runtime.backends.fake import simulated_device


def load_on_simulated(path, cache_dir, placement: str = "", graphs: bool = True, kv_type: str = "f16"):
    """(model, [sim:0, sim:1]) with the units moved as `placement` says ("SEL=TARGET,..."), the devices
    capturing steps unless `graphs` is off."""
    devices = [simulated_device("sim:0", graphs=graphs), simulated_device("sim:1", graphs=graphs)]
    model = load(path, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type=kv_type,
                 extra_devices=devices)
    for part in placement.split(","):
        if part:
            model.move(*part.split("="))
    return model, devices
