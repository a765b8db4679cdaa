"""The one base class of mtpkit's own errors: bad input whose message says what is wrong and how to fix it.

It is a ValueError, so callers that already catch ValueError keep working; the CLI prints it as one line.
"""


class MtpkitError(ValueError):
    """Bad input (a file, a config value, an argument): the message names the problem and the fix."""


class CheckpointError(MtpkitError):
    """A checkpoint that does not match its config, cannot be read, or cannot be written where asked."""
