"""The one error type users see: the CLI prints its message on one line and exits with code 2."""


class JitllmError(Exception):
    """A problem with the user's input or environment, described in one line."""


class DeviceFault(JitllmError):
    """A device failed while running (allocation or launch error); the host can take over."""

    def __init__(self, device: str, reason: str) -> None:
        super().__init__(f"{device}: {reason}")
        self.device = device


def shown(value: object, limit: int = 40) -> str:
    """`value` as a one-line message quotes it: its repr, cut short (a crafted file may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
