"""Checks of fsspec ``storage_options`` before anything connects, and ``check_storage``.

A misspelt option (``endpoint-url``, ``client_kwargs.endpoint-url``) is otherwise accepted
by fsspec and surfaces much later as a misleading error ("the bucket does not exist"), after
hours of training. Keys are checked against the filesystem class's constructor; for S3 the
nested ``client_kwargs`` (botocore's ``create_client``) and ``config_kwargs`` (botocore's
``Config``) are checked the same way. Every refusal is a :class:`ConfigError` naming the
dotted key and, when there is one, the closest valid key.
"""

from __future__ import annotations

import difflib
import inspect
import json
from typing import Any

from zerostate.errors import ConfigError

#: Accepted by every fsspec filesystem (instance and listings caches), not in signatures.
_FSSPEC_COMMON = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}


def _constructor_params(cls: type) -> dict[str, inspect.Parameter]:
    params: dict[str, inspect.Parameter] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        try:
            signature = inspect.signature(init) if init is not None else None
        except (TypeError, ValueError):
            signature = None
        for p in signature.parameters.values() if signature else ():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                params[p.name] = p
    return params


def _nested_known(protocol: str, key: str) -> set[str] | None:
    """Valid keys inside the dict option ``key`` of ``protocol``, or None when open-ended."""
    if protocol not in ("s3", "s3a"):
        return None
    try:
        if key == "client_kwargs":
            from botocore.session import Session

            names = set(inspect.signature(Session.create_client).parameters)
            return names - {"self", "service_name"}
        if key == "config_kwargs":
            from botocore.config import Config

            return set(Config.OPTION_DEFAULTS)
    except ImportError:
        return None
    return None  # s3_additional_kwargs: any S3 request parameter


def _unknown(key: str, shown: str, protocol: str, known: set[str]) -> ConfigError:
    close = difflib.get_close_matches(key.replace("-", "_"), sorted(known), n=1)
    hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
    return ConfigError(f"{shown}: {protocol}:// takes no option {key!r}; {hint}")


def validate_storage_options(url: str, options: dict[str, Any] | None) -> None:
    """Raise :class:`ConfigError` for options the filesystem of ``url`` would reject (or
    silently ignore) only once it connects: an unknown key at the top level or inside
    ``client_kwargs`` / ``config_kwargs``, a non-dict ``*_kwargs``, a non-boolean switch,
    options for a local path. Each message starts with the dotted key."""
    if not options:
        return
    if not isinstance(options, dict):
        raise ConfigError(f"storage_options must be a dict, got {type(options).__name__}")
    protocol, sep, _ = url.partition("://")
    if not sep or protocol.lower() in ("file", "local"):
        raise ConfigError(
            f"storage options apply to URLs (s3://...) only, and {url!r} is a local path: drop them"
        )
    import fsspec

    protocol = protocol.split("::")[-1].lower()
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"cannot use {url!r}: {exc}") from None
    params = _constructor_params(cls)
    known = set(params) | _FSSPEC_COMMON
    for key, value in options.items():
        if key not in known:
            raise _unknown(key, key, protocol, known)
        default = params[key].default if key in params else None
        if key.endswith("_kwargs"):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{key}={json.dumps(value, default=str)} must be a JSON object, e.g. "
                    f'{key}=\'{{"region_name": "us-east-1"}}\' or {key}.region_name=us-east-1'
                )
            inner = _nested_known(protocol, key)
            for sub in value if inner is not None else ():
                if sub not in inner:
                    raise _unknown(sub, f"{key}.{sub}", f"{protocol}:// {key}", inner)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        if type(default) is int and (type(value) is not int):
            raise ConfigError(f"{key}={value!r} must be a whole number")


def check_storage(url: str, storage_options: dict | None = None) -> str:
    """Check, before training, that ``url`` can hold checkpoints: the options are valid
    (see :func:`validate_storage_options`), a local root can be created, an object store's
    bucket exists and these credentials see it. Creates nothing but a local directory.
    Returns the root's canonical location; raises :class:`ConfigError` or
    :class:`~zerostate.errors.StorageError` naming the fix."""
    from zerostate.store.storage import open_storage

    validate_storage_options(url, storage_options)
    storage = open_storage(url, storage_options)
    storage.check_writable()
    return storage.location
