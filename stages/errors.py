"""The errors stages/ raises. Each names the bad value; the CLI prints them without a traceback."""


class StageError(Exception):
    """Base of every error stages/ raises on purpose."""


class ModelFormatError(StageError):
    """A model folder or file is missing, corrupt, or holds tensors of the wrong shape."""


class UnsupportedModel(StageError):
    """The model's architecture or an option of it is outside what the engine runs."""


class ContextOverflow(StageError):
    """A session would grow past its preallocated KV cache or the model's context."""


class StateRewindError(ContextOverflow):
    """A step or rollback goes back to a position a session's state no longer reaches (a recurrent
    state: stages/layers/state.py; a compressed layer's rings: stages/layers/cache.py): the session
    must be replayed from position 0."""


class UnknownSession(StageError):
    """A forward, rollback or close names a session this stage does not hold."""


class SpanError(StageError):
    """A requested layer span lies outside what this stage holds."""


class NonFiniteActivations(StageError):
    """A stage produced or received NaN or Inf activations."""
