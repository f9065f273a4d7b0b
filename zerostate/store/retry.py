"""Retry policy of every storage backend: which errors a retry may cure, and the loop.

[Note: storage retries]
Object stores fail transiently (connection resets, throttling, 5xx answers); local disks
almost never do, and when they do (EIO on a flaky mount) a short retry is cheap. So every
backend call goes through :meth:`RetryPolicy.call`: a transient error is retried with
exponential backoff, anything else (a missing object, a permission or configuration
problem, a programming error) comes back at once, and the last failure becomes one
:class:`~zerostate.errors.StorageError` naming the URL, the attempts and the cause. Client
libraries keep their own inner retries short (see ``s3.with_s3_defaults``), so the waits do
not multiply.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from zerostate.errors import ConfigError, StorageError, ZerostateError

T = TypeVar("T")

#: Errors that no retry can fix: give them back at once.
PERMANENT_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.EACCES,
        errno.EPERM,
        errno.EINVAL,
        errno.ENOSPC,
        errno.EROFS,
        errno.EEXIST,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.EDQUOT,
        errno.ENAMETOOLONG,
    }
)
#: Modules whose exceptions are network / service failures a retry may cure.
NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http")
#: Client errors that name a setting to fix (credentials, region, a bad parameter).
CONFIG_ERRORS = frozenset(
    {
        "ParamValidationError",
        "NoCredentialsError",
        "PartialCredentialsError",
        "NoRegionError",
        "InvalidRegionError",
        "UnknownServiceError",
        "InvalidConfigError",
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help: connection trouble, timeouts, throttling, 5xx answers.
    Programming errors and bad arguments (ValueError, KeyError, TypeError, RuntimeError...)
    fail at once: retrying them only delays the real message."""
    if isinstance(exc, OSError):
        return exc.errno not in PERMANENT_ERRNOS and not isinstance(exc, PermissionError)
    if isinstance(exc, TimeoutError):
        return True
    if any(cls.__name__ in CONFIG_ERRORS for cls in type(exc).__mro__):
        return False
    module = type(exc).__module__.split(".", 1)[0]
    return module in NETWORK_MODULES


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently a backend retries a transient failure."""

    attempts: int = 5
    """Calls in all, the first included (1: never retry)."""
    first_delay_s: float = 0.1
    """Sleep before the second attempt."""
    factor: float = 4.0
    """Each further sleep is this many times the previous one..."""
    max_delay_s: float = 3.0
    """...up to this."""

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("first_delay_s", "factor", "max_delay_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"RetryPolicy.{name} must be a number >= 0, got {value!r}")

    def delays(self) -> list[float]:
        """The sleeps between attempts, in order (``attempts - 1`` of them)."""
        out, delay = [], self.first_delay_s
        for _ in range(self.attempts - 1):
            out.append(delay)
            delay = min(delay * self.factor, self.max_delay_s)
        return out

    def call(
        self,
        what: str,
        url: str,
        fn: Callable[[], T],
        sleep: Callable[[float], object] | None = None,
    ) -> T:
        """``fn()``, retried while it fails transiently (see [Note: storage retries]).
        A missing object (``FileNotFoundError``) and zerostate's own errors pass through
        unchanged; every other failure becomes a :class:`StorageError` naming ``url``."""
        delays = self.delays()
        for attempt in range(self.attempts):
            try:
                return fn()
            except (FileNotFoundError, ZerostateError):
                raise  # a missing object is an answer; our own errors are already clear
            except Exception as exc:
                # Network clients raise their own classes (botocore's EndpointConnectionError
                # is no OSError); all of them end up as one StorageError naming the URL.
                if not is_transient(exc) or attempt == self.attempts - 1:
                    raise StorageError(
                        f"{what} {url} failed"
                        + (f" after {attempt + 1} attempts" if attempt else "")
                        + f": {type(exc).__name__}: {exc}"
                    ) from exc
            (sleep or time.sleep)(delays[attempt])  # looked up now: tests patch time.sleep
        raise AssertionError("unreachable")
