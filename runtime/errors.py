"""Errors the command line turns into one clear line and a non-zero exit (no traceback)."""


class AiaynError(Exception):
    """Base of every error whose message is meant for the user as is."""


class CorpusError(AiaynError, ValueError):
    """A missing, unreadable or inconsistent corpus file."""


class TokenizerError(AiaynError, ValueError):
    """A sentencepiece model that is missing or does not follow the contract's special ids."""


class PackageError(AiaynError, ValueError):
    """A model package that is missing, damaged, of an unknown version or fails its checks."""


class CheckpointError(AiaynError, ValueError):
    """A checkpoint that is missing, damaged or fails its checksums."""


class BackendError(AiaynError, RuntimeError):
    """A backend that cannot run here (missing package, provider or device)."""


class InputTooLongError(AiaynError, ValueError):
    """An input longer than the model's max_positions with on_long='error'."""
