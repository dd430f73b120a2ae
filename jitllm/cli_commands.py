"""The explicit list of CLI verbs (no import magic)."""

from jitllm.commands.batch import batch
from jitllm.commands.chat import chat
from jitllm.commands.compile import compile_command
from jitllm.commands.convert import convert
from jitllm.commands.daemon import models, place, serve, sessions
from jitllm.commands.hardware import hardware
from jitllm.commands.perplexity import perplexity
from jitllm.commands.run import run
from jitllm.commands.speed import speed
from jitllm.commands.tokenize import tokenize
from jitllm.commands.verify import verify

COMMANDS = [run, chat, convert, compile_command, verify, speed, batch, perplexity, hardware, tokenize]
DAEMON_COMMANDS = [serve, models, sessions, place]
