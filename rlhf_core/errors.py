"""Errors the user can fix: the CLI prints the message in one sentence and exits 2."""


class UserError(Exception):
    """A mistake in the user's input (flag, config field, file); the message says what to do."""


class CorruptCheckpoint(UserError):
    """A checkpoint's bytes disagree with its manifest; resume falls back to an older one."""

    def __init__(self, message: str, step: int, reason: str):
        super().__init__(message)
        self.step, self.reason = step, reason

    def __reduce__(self):  # Ray pickles a rank's exception to the driver; __init__ takes three arguments
        return (type(self), (self.args[0], self.step, self.reason))


class UnsafeCheckpoint(UserError):
    """A checkpoint file would run code when unpickled; it is refused, never loaded."""
