"""The engine's one error hierarchy."""


class EngineError(Exception):
    """Base of every error the engine raises to its callers."""


class RequestRejected(EngineError):
    """The request is invalid or cannot be served (HTTP 4xx). ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelNotFound(RequestRejected):
    """The request names a model this server does not serve (HTTP 404, as vLLM)."""


class QueueFull(RequestRejected):
    """The waiting queue is at its bound (HTTP 503 with Retry-After)."""


class RequestFailed(EngineError):
    """One request failed inside the engine after it was admitted (its
    detokenizer or stop strings raised, HTTP 500); the engine and every other
    request go on. ``stage`` names the part that failed."""

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage


class EngineDead(EngineError):
    """The engine stopped: an actor failed or it was shut down."""
