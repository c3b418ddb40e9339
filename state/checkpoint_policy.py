"""When and where durable checkpoints are written: a self-validating config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    """Persist to ``uri`` every ``every_n_commits`` commits and/or every ``every_s``
    seconds (whichever comes first); keep the newest ``keep_last`` checkpoints."""

    uri: str
    every_n_commits: int | None = None
    every_s: float | None = None
    keep_last: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri:
            raise ValueError(f"CheckpointConfig.uri={self.uri!r} must be a path or fsspec URL (e.g. /data/ckpt, s3://bucket/job)")
        if self.every_n_commits is None and self.every_s is None:
            raise ValueError("CheckpointConfig needs every_n_commits or every_s (or both): say how often to persist")
        if self.every_n_commits is not None and (not isinstance(self.every_n_commits, int) or self.every_n_commits < 1):
            raise ValueError(f"CheckpointConfig.every_n_commits={self.every_n_commits!r} must be an int >= 1")
        if self.every_s is not None and (not isinstance(self.every_s, (int, float)) or self.every_s <= 0):
            raise ValueError(f"CheckpointConfig.every_s={self.every_s!r} must be a number of seconds > 0")
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last={self.keep_last!r} must be an int >= 1")
