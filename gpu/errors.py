"""The error a model that cannot be loaded raises (imported by every layer of gpu/)."""


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file and the problem."""
