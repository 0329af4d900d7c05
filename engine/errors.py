"""The errors bad input raises, wherever in the engine it is found: a caller's request, a
checkpoint's files."""


class InvalidRequest(ValueError):
    """Bad input from a caller. `field` names the offending parameter."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # raised in a Ray worker, it must unpickle in the router as itself
        return type(self), (self.field, self.message)


class CheckpointError(ValueError):
    """A checkpoint folder the engine cannot serve: the message names the file and the key."""
