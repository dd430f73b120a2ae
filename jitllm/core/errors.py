"""The one error type users see: the CLI prints its message on one line and exits with code 2."""


class JitllmError(Exception):
    """A problem with the user's input or environment, described in one line."""


class DeviceFault(JitllmError):
    """A device failed while running (allocation or launch error); the host can take over."""

    def __init__(self, device: str, reason: str) -> None:
        super().__init__(f"{device}: {reason}")
        self.device = device
