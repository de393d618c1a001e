"""Errors a user can cause; each message names the file, tensor, key or flag at fault."""


class Ds4Error(Exception):
    """Base class of every error ds4py raises on purpose."""


class ModelFileError(Ds4Error):
    """A GGUF/safetensors file is unreadable, malformed, truncated or not a DeepSeek V4 model."""


class BackendUnavailable(Ds4Error):
    """A backend or op implementation was asked for explicitly and cannot run here."""


class UsageError(Ds4Error):
    """Bad arguments: flags, prompt longer than the context, inconsistent options."""


class NonFiniteError(Ds4Error):
    """The model produced NaN or Inf where a finite value is needed (e.g. the logits of a step)."""


class SessionFileError(Ds4Error):
    """A session file (Session.save) that cannot be loaded: damaged, truncated, or saved for another model,
    layout, context or prefill chunk."""
