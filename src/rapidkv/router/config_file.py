"""The router's settings from a TOML file (`rapidkv router --config FILE`),
merged with the command line's, into a `RouterConfig`.

A file is a flat TOML table whose keys are `RouterConfig`'s fields (units in
their names: ``*_s`` seconds, ``*_ms`` milliseconds, ``*_bytes``), plus:

- ``secret_file``, ``admin_token_file``: paths of the files holding the
  control plane's shared secret and the admin token (the secrets themselves
  are never written in the file: ``secret`` and ``admin_token`` are refused);
  a relative path is relative to the file's directory;
- ``log_level``: ``debug``, ``info``, ``warning`` or ``error``;
- ``prefill``, ``decode``, ``instances``: lists of ``URL[=CONTROL_ADDR]``
  strings, as the ``--prefill``, ``--decode`` and ``--instance`` flags take.

Invariants (pure: no I/O but `read_file`'s and `resolve`'s reading of the
files named):
- every key is known and every value has its field's type, else `ValueError`
  naming the file and the key (an unknown key names the closest known one);
  values out of range are refused by `RouterConfig` itself, whose messages
  name the field;
- a setting given on the command line replaces the file's (`merge`); a list
  flag (``--prefill``) replaces the file's whole list;
- a file with no key is a valid file (every setting at its default).
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from rapidkv.control.framing import read_secret_file
from rapidkv.router.config import Instance, RouterConfig

LOG_LEVELS = ("debug", "info", "warning", "error")

# RouterConfig fields a file may not set: secrets inline (their files instead)
# and test hooks
REFUSED = {
    "secret": "write the secret in a file and give its path as secret_file",
    "admin_token": "write the token in a file and give its path as admin_token_file",
    "debug_first_token_mismatch": "a test hook, not a setting",
}
INSTANCE_LISTS = ("prefill", "decode", "instances")
# keys that are not RouterConfig fields, and their types
EXTRA: dict[str, Any] = {
    "secret_file": str,
    "admin_token_file": str,
    "log_level": Literal["debug", "info", "warning", "error"],
}


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(RouterConfig)
    out = {f.name: hints[f.name] for f in dataclasses.fields(RouterConfig) if f.init}
    for name in INSTANCE_LISTS:
        out[name] = list[str]
    for name in REFUSED:
        out.pop(name, None)
    return {**out, **EXTRA}


KEYS: dict[str, Any] = _field_types()
"""Every key a file may hold, and the type of its value."""


def read_file(path: Path) -> dict[str, Any]:
    """The settings in the TOML file `path`, checked (`check`); relative file
    paths in it are made relative to its directory. `ValueError` naming the
    file for an unreadable, malformed or invalid one."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path}: not valid TOML: {e}") from None
    settings = check(table, str(path))
    for key in ("secret_file", "admin_token_file"):
        if key in settings:
            settings[key] = str(path.parent / settings[key])
    return settings


def check(table: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """`table`'s settings, each key known and each value of its type
    (`ValueError` naming `source` and the key otherwise)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in REFUSED:
            raise ValueError(f"{source}: key {key!r} may not be set here: {REFUSED[key]}")
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{source}: unknown key {key!r}{hint}")
        problem = _type_problem(value, KEYS[key])
        if problem is not None:
            raise ValueError(f"{source}: key {key!r}: {problem}, not {value!r}")
        out[key] = float(value) if KEYS[key] is float else value
    return out


def merge(from_file: dict[str, Any], from_flags: dict[str, Any]) -> dict[str, Any]:
    """The settings in effect: the file's, each replaced by the flag's when one was given."""
    return {**from_file, **from_flags}


def resolve(settings: dict[str, Any]) -> RouterConfig:
    """The `RouterConfig` of `settings` (checked keys: `check`); the secret
    and admin token are read from their files. `ValueError` if it is not
    valid (an unreadable or empty secret file too)."""
    kwargs = {k: v for k, v in settings.items() if k not in EXTRA}
    for name in INSTANCE_LISTS:
        if name in kwargs:
            try:
                kwargs[name] = tuple(Instance.parse(text) for text in kwargs[name])
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    if "etcd" in kwargs:
        kwargs["etcd"] = tuple(url.rstrip("/") for url in kwargs["etcd"])
    if settings.get("secret_file") is not None:
        kwargs["secret"] = read_secret_file(settings["secret_file"])
    if settings.get("admin_token_file") is not None:
        kwargs["admin_token"] = read_secret_file(settings["admin_token_file"]).decode()
    return RouterConfig(**kwargs)


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _type_problem(value: Any, hint: Any) -> str | None:
    """What is wrong with `value` as a `hint` (None: nothing)."""
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        problems = [_type_problem(value, a) for a in options]
        return None if None in problems else problems[0]
    if origin is Literal:
        choices = get_args(hint)
        return None if value in choices else f"expected one of {', '.join(choices)}"
    if origin in (tuple, list):
        item = get_args(hint)[0]
        if not isinstance(value, list):
            return f"expected a list of {_PLURALS[item]}"
        for v in value:
            if _type_problem(v, item) is not None:
                return f"expected a list of {_PLURALS[item]} ({v!r} is not)"
        return None
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is str:
        ok = isinstance(value, str)
    else:  # a field type this module does not know: a bug here, not in the file
        raise TypeError(f"no check for {hint!r}")
    return None if ok else f"expected {_NAMES[hint]}"
