"""The one error type users see. The CLI prints its message on one line and exits 2."""


class UserError(ValueError):
    """Bad input from the user: a recipe key, an override, a missing file. Message names it and a fix."""
