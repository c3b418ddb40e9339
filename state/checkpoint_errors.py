"""The errors of durable checkpoints (a module of their own so that every checkpoint module can raise them)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file or location and the fix."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint is damaged (unreadable manifest, data that does not match it): loading falls back
    to the previous valid checkpoint."""


class CheckpointRefused(CheckpointError):
    """A checkpoint is intact but must not be loaded here (another job's state, or objects that a
    ``weights_only`` load refuses): loading stops rather than silently resuming something older."""


class CheckpointPruneError(CheckpointError):
    """The checkpoint ``uri`` was written and verified, but removing older ones failed."""

    def __init__(self, message: str, uri: str) -> None:
        super().__init__(message)
        self.uri = uri
