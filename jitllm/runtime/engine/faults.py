"""Device failures during a step, as DeviceFault: the device is given up and the work finishes elsewhere."""

from __future__ import annotations

import contextlib

from jitllm.core.errors import DeviceFault
from jitllm.runtime.backends.host import HOST
from jitllm.runtime.device import Device


def last_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


@contextlib.contextmanager
def device_faults(device: Device):
    """Errors of work on a device as DeviceFault (backends report device failures, allocation and launch,
    as their own errors), so the device is given up and the step retried elsewhere; the host's stay as
    they are."""
    try:
        yield
    except DeviceFault:
        raise
    except Exception as e:
        if device.name == HOST:
            raise
        raise DeviceFault(device.name, last_line(e)) from e
