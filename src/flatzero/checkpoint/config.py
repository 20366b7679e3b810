"""Frozen, validated options of checkpoint saving, loading and export."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import SHORT_DTYPES

__all__ = ["LOAD_FALLBACKS", "ExportConfig", "LoadConfig", "SaveConfig"]

LOAD_FALLBACKS = ("none", "newest_valid")
"""``LoadConfig.fallback`` choices."""

EXPORT_DTYPES = (*SHORT_DTYPES, "saved")
"""``ExportConfig.dtype`` choices; ``saved`` keeps each param's training dtype."""


@dataclass(frozen=True)
class SaveConfig:
    """How ``save_checkpoint`` writes.

    Attributes:
        save_rng: also store each rank's RNG states (torch CPU and CUDA, Python ``random``,
            NumPy when imported) in its rank file; ``load_checkpoint`` restores them when
            loading at the same world size.
        checksums: record the checksums of every tensor, per 8 MiB chunk, in ``meta.json``
            (computed on the bytes as they are written; loads verify them by default).
        overwrite: replace an existing checkpoint of the same tag; else that is an error.
        update_latest: point ``latest`` at the new checkpoint once it is complete.
        keep_last: after a successful save, remove the oldest complete checkpoints of the
            directory until this many remain (by save time); ``None`` keeps all.
        stale_tmp_age_s: remove ``.tmp-*`` directories left by killed saves once they are
            this many seconds old (seconds; ``None``: never remove them).
    """

    save_rng: bool = False
    checksums: bool = True
    overwrite: bool = False
    update_latest: bool = True
    keep_last: int | None = None
    stale_tmp_age_s: float | None = 3600.0

    def __post_init__(self) -> None:
        if self.keep_last is not None and (
            not isinstance(self.keep_last, int) or isinstance(self.keep_last, bool)
        ):
            raise ValueError(f"SaveConfig.keep_last must be an int or None, got {self.keep_last!r}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"SaveConfig.keep_last must be >= 1, got {self.keep_last}")
        if self.stale_tmp_age_s is not None and not self.stale_tmp_age_s >= 0:
            raise ValueError(
                f"SaveConfig.stale_tmp_age_s must be >= 0 seconds or None, got "
                f"{self.stale_tmp_age_s!r}"
            )


@dataclass(frozen=True)
class LoadConfig:
    """How ``load_checkpoint`` reads.

    Attributes:
        strict: every trainable param of the model must be in the checkpoint with the same
            shape and every saved param must be in the model. ``False`` keeps the current
            value (and fresh optimizer state) of params the checkpoint lacks and ignores
            saved params the model lacks.
        load_optimizer_states: restore the inner optimizer's state (moments, ``step``,
            hyperparameters) and the loss scaler; ``False`` loads the master weights only.
        load_scheduler: restore the LR scheduler passed to ``load_checkpoint``.
        load_rng: restore the RNG states when the checkpoint has them and was saved at the
            same world size (at another world size they are skipped with a warning).
        verify: check every byte this rank reads against the checksums recorded at save
            (crc32c, one per 8 MiB chunk), as it is read: no second pass (measured: 1.04x
            the wall time of an unverified load, docs/checkpoints.md). ``False`` skips it
            (checkpoints saved without checksums are never verified).
        fallback: what a load does when the checkpoint is missing, incomplete or corrupt:
            ``"none"`` raises on every rank, naming the newest tag of the directory that is
            complete and verifies; ``"newest_valid"`` loads that tag instead, with a
            warning (for preemptible clusters; ``LoadResult.tag`` says which was loaded).
    """

    strict: bool = True
    load_optimizer_states: bool = True
    load_scheduler: bool = True
    load_rng: bool = True
    verify: bool = True
    fallback: str = "none"

    def __post_init__(self) -> None:
        if self.fallback not in LOAD_FALLBACKS:
            raise ValueError(
                f"LoadConfig.fallback must be one of {LOAD_FALLBACKS}, got {self.fallback!r}"
            )


@dataclass(frozen=True)
class ExportConfig:
    """How ``export_checkpoint`` writes consolidated weights.

    Attributes:
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` (from the fp32 master weights), or
            ``"saved"`` (each param's training dtype).
        max_shard_bytes: bytes per output file at most (bytes; a bigger tensor gets a file
            of its own); one file needs no index.
        include_tied: also write tied params under their second names (for loaders that
            do not tie weights themselves).
        include_rest: also write the frozen params and buffers saved with the checkpoint.
    """

    dtype: str = "bf16"
    max_shard_bytes: int = 5 * 10**9
    include_tied: bool = False
    include_rest: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(
                f"ExportConfig.dtype is {self.dtype!r}; use one of {', '.join(EXPORT_DTYPES)}"
            )
        if (
            not isinstance(self.max_shard_bytes, int)
            or isinstance(self.max_shard_bytes, bool)
            or self.max_shard_bytes < 1
        ):
            raise ValueError(
                f"ExportConfig.max_shard_bytes must be a positive int (bytes), got "
                f"{self.max_shard_bytes!r}"
            )
