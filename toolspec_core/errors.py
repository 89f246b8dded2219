"""Exception types raised for bad input: each carries a message a user can act on."""

from __future__ import annotations


class ToolSpecError(Exception):
    """Base class of every error ToolSpec raises on purpose."""


class InvalidRequestError(ToolSpecError, ValueError):
    """The request is malformed (empty prompt, bad sampling parameters, bad tool schema...).
    ``param``: the request parameter it is about; ``code``: the OpenAI error code a server answers."""

    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt (+ requested tokens) does not fit the target's context window or the KV pool."""

    code = "context_length_exceeded"
