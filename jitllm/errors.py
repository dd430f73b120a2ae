"""The one error type users see: the CLI prints its message on one line and exits with code 2."""


class JitllmError(Exception):
    """A problem with the user's input or environment, described in one line."""
