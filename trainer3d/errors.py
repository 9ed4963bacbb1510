"""The errors a user can fix: each message is one sentence naming the fix, and the entry point turns any of them
into that sentence on stderr and exit code 2 (no traceback). Everything else is a bug or a failed collective."""


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
