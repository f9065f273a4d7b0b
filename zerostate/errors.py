"""Error classes. Each also inherits the builtin a caller would naturally catch."""

from __future__ import annotations


class ZerostateError(Exception):
    """Base of every error zerostate raises on purpose."""


class ConfigError(ZerostateError, ValueError):
    """A setting is invalid; the message names the setting, the value and the fix."""


class CheckpointError(ZerostateError):
    """Base for problems with a checkpoint on storage."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint, no committed step, or no such step at the given location."""


class FormatVersionError(CheckpointError, ValueError):
    """The checkpoint was written in a format version this zerostate cannot read."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Metadata is malformed, or a chunk is missing, truncated or fails its checksum."""


class LayoutError(CorruptCheckpointError):
    """A tensor's tensor- or data-parallel layout is inconsistent, or its stored pieces do not
    tile it exactly; one line naming the tensor and the problem. Layouts built in memory use it
    too, so a reader and a writer refuse the same layouts with the same words."""


class UnsafeNameError(CheckpointError, ValueError):
    """A tensor name or step read from storage would escape the checkpoint directory."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed (after bounded retries) or is unreachable."""


class CommitTimeoutError(CheckpointError, TimeoutError):
    """Not every rank finished writing its shards within the save timeout."""


class DistributedMismatchError(ZerostateError, ValueError):
    """Ranks disagree about something that must be identical (model shapes, names, config)."""


class PretrainedMismatchError(ZerostateError, ValueError):
    """A pretrained checkpoint's tensor names or shapes do not fit the model."""


class CollectiveTimeoutError(ZerostateError, TimeoutError):
    """Not every rank entered a collective call (save, load, ...) within the deadline."""


class StageUsageError(ZerostateError, RuntimeError):
    """The partitioned model was used in a way the runtime cannot serve."""


class GradientAccessError(ZerostateError, RuntimeError):
    """A parameter's ``.grad`` was used between ``engine.backward()`` and ``engine.step()``,
    where it does not hold the step's gradient (``torch.nn.utils.clip_grad_norm_``, say)."""


class EngineUsageError(ZerostateError, RuntimeError):
    """The engine's methods were called in an order it cannot honour."""
