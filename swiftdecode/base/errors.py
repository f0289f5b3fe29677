"""Errors that reach the user as one line (CLI exit code 2, HTTP 4xx)."""


class UserError(Exception):
    """Bad input from the user: message is shown as-is, without a traceback."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
