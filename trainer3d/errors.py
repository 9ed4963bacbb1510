"""The errors a user can fix: each message is one sentence naming the fix, and the entry point turns any of them
into that sentence on stderr and exit code 2 (no traceback). Everything else is a bug or a failed collective."""

import argparse
import difflib
import os
import re
import sys

PREFIX = "trainer3d: error: "  # every entry point's, so that a log or a wrapper script can grep one thing


class UsageError(ValueError):
    """Bad input: a flag, file, layout, corpus or checkpoint that cannot work."""


class ConfigError(UsageError):
    """A flag or configuration file that cannot work."""


class LayoutError(ConfigError):
    """A (dp, tp, pp) layout, schedule or batch split that cannot work."""


class DataError(UsageError):
    """A corpus or tokenizer that cannot be loaded."""


class CheckpointError(UsageError):
    """A checkpoint (or Hugging Face directory) that cannot be saved or loaded; the sentence names the file."""


class TrainingError(UsageError):
    """A run that cannot go on as it is (a non-finite loss or gradient norm); the sentence names the step and what to
    change."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (or its type's name), for one-sentence reports."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def report(e: BaseException | str, rank: int = 0) -> int:
    """Print bad input's one sentence, on rank 0 only (every rank validates alike), and return exit code 2."""
    if rank == 0:
        print(f"{PREFIX}{e}", file=sys.stderr)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, `--tp abc`, a missing path) as one sentence and exit code 2, like every
    other bad input: argparse's usage block (67 lines for the trainer) once per rank buried the sentence. A misspelt
    flag is told the nearest one (difflib at 0.75: a respelling such as --seq_len or --epoch, not a guess)."""

    def error(self, message: str):
        sys.exit(report(f"{message}{self._nearest_flag(message)}; see {self.prog} --help.",
                        int(os.environ.get("RANK", "0"))))

    def _nearest_flag(self, message: str) -> str:
        if not message.startswith("unrecognized arguments:"):
            return ""
        flags = set(re.findall(r"--[\w-]+", self.format_usage()))  # (the usage line names every flag)
        for word in message.split(":", 1)[1].split():
            close = difflib.get_close_matches(word.split("=")[0], sorted(flags), n=1, cutoff=0.75)
            if word.startswith("--") and close:
                return f" (did you mean {close[0]}?)"
        return ""
