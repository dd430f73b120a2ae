"""The explicit list of CLI verbs (no import magic)."""

from jitllm.commands.hardware import hardware

COMMANDS = [hardware]
