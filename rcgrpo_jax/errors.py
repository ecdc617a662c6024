"""The error every layer raises for bad user input (usable anywhere, like `config`)."""


class UserError(Exception):
    """A problem with the user's config or inputs: reported as one line, without a traceback."""
