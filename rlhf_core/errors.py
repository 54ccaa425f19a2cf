"""Errors the user can fix: the CLI prints the message in one sentence and exits 2."""


class UserError(Exception):
    """A mistake in the user's input (flag, config field, file); the message says what to do."""
