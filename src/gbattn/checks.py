"""Typed configuration records: every field is coerced to its declared type where a value enters
(JSON from a run directory, ``--set key=value`` from the command line, Python keyword arguments)
and checked against its declared range, with an error that names the field.

Rules: an ``int`` field takes an integer (numpy's too) or an integral float (``128.0`` -> 128), never a
string or a bool; a ``float`` field takes a finite number; a ``bool`` field takes true/false; a ``str`` field a
string; a list field a JSON list or a comma-separated string; ``X | None`` also takes null. Nothing
here imports the rest of gbattn, so any module may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any

from gbattn.errors import ConfigError

MAX_INT = 2**63 - 1  # the largest integer torch, numpy and the C libraries below take


def between(minimum: int, maximum: int) -> dict:
    """An integer in [minimum, maximum]."""
    def test(name: str, value: Any) -> None:
        if not minimum <= value <= maximum:
            raise ConfigError(f"{name}={value!r} must be an integer in [{minimum}, {maximum}]")

    return {"check": test}


def near_miss(value: Any, allowed) -> str | None:
    """The entry of ``allowed`` that ``value`` is a typo of (``paper-smal``: ``paper-small``; two neighbouring
    letters swapped, ``cdua``: ``cuda``, which in a short name is too far for the similarity cutoff), or None."""
    if not isinstance(value, str):
        return None
    names = [str(a) for a in allowed]
    match = difflib.get_close_matches(value, names, n=1, cutoff=0.8)
    return match[0] if match else next((name for name in names if _one_swap_apart(value, name)), None)


def _one_swap_apart(a: str, b: str) -> bool:
    """Whether ``b`` is ``a`` with two neighbouring characters swapped."""
    differ = [k for k in range(len(a)) if len(a) == len(b) and a[k] != b[k]]
    if len(differ) != 2:
        return False
    i, j = differ
    return j == i + 1 and (a[i], a[j]) == (b[j], b[i])


def did_you_mean(values, allowed) -> str:
    """`` (did you mean 'x'?)`` naming the :func:`near_miss` of each of ``values`` (one value, or a list of them), or
    ``""`` when none has one (a value of any other type has none: not iterated)."""
    close = []
    for value in values if isinstance(values, list) else [values]:
        match = near_miss(value, allowed)
        close += [match] if match is not None and match not in close else []
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def check_choice(name: str, value: Any, allowed) -> None:
    """``value`` must be one of ``allowed`` (the error names a near miss: :func:`did_you_mean`)."""
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed{did_you_mean([value], allowed)}; choose one of "
                          f"{', '.join(map(str, allowed))}")


# --------------------------------------------------------------------------------------
# Range checks, attached to fields as ``field(metadata=check(...))``
# --------------------------------------------------------------------------------------


def at_least(minimum: float) -> dict:
    def test(name: str, value: Any) -> None:
        if value < minimum:
            kind = "an integer " if isinstance(value, int) else ""
            raise ConfigError(f"{name}={value!r} must be {kind}>= {minimum}")

    return {"check": test}


def greater_than(minimum: float) -> dict:
    def test(name: str, value: Any) -> None:
        if not value > minimum:
            raise ConfigError(f"{name}={value!r} must be > {minimum}")

    return {"check": test}


FLOAT32_MAX, FLOAT32_LEAST = 3.4028234663852886e38, 1.401298464324817e-45  # the largest, and the smallest above 0


def positive_float32() -> dict:
    """A number > 0 that float32 holds as one (norm_eps=1e39 became inf, and the model trained to a uniform output;
    1e-50 became 0, which norm_eps=0 is refused for)."""
    def test(name: str, value: Any) -> None:
        if not FLOAT32_LEAST <= value <= FLOAT32_MAX:
            raise ConfigError(f"{name}={value!r} must be > 0 and within float32's range ({FLOAT32_LEAST:.1e} to "
                              f"{FLOAT32_MAX:.1e}): the model computes with it in float32")

    return {"check": test}


def within(limit: float) -> dict:
    """A number in [-limit, limit] (a float32 parameter's initial value: 1e39 overflowed it in a traceback)."""

    def test(name: str, value: Any) -> None:
        if not -limit <= value <= limit:
            raise ConfigError(f"{name}={value!r} must be in [{-limit:g}, {limit:g}]")

    return {"check": test}


def fraction() -> dict:
    """A value in [0, 1)."""

    def test(name: str, value: Any) -> None:
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name}={value!r} must be in [0, 1)")

    return {"check": test}


def one_of(*allowed: str) -> dict:
    def test(name: str, value: Any) -> None:
        check_choice(name, value, allowed)

    return {"check": test, "choices": allowed}


def each_one_of(*allowed: str) -> dict:
    """Every element of a list is one of ``allowed`` (and none repeats)."""

    def test(name: str, value: list) -> None:
        for item in value:
            check_choice(f"{name} entry", item, allowed)
        if len(set(value)) != len(value):
            raise ConfigError(f"{name}={value!r} lists an entry twice")

    return {"check": test, "choices": allowed}


# --------------------------------------------------------------------------------------
# Coercion by declared type
# --------------------------------------------------------------------------------------


def parse_value(text: str, name: str = "the value") -> Any:
    """A ``--set`` value: JSON where it parses (numbers, true/false, null, lists), else the raw string.
    ``NaN`` and ``Infinity`` stay strings (and are refused by number fields); ``name`` is how an error names it."""
    try:
        return json.loads(text, parse_constant=lambda constant: constant)
    except ValueError:  # not JSON, or an integer of more digits than Python converts (4,300)
        return text
    except RecursionError:  # thousands of nested lists: a RecursionError traceback
        raise ConfigError(f"{name}: nested too deeply to read") from None


def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0]).split(' ', 1)[-1]}s" if args else "a list"  # "a number": "numbers"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
            list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(name: str, value: Any, tp) -> Any:
    """``value`` as type ``tp`` (see the module docstring), or a ConfigError naming ``name``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(name, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{name}={value!r} must be {_type_name(tp)}")
    if origin is list or tp is list:
        args = typing.get_args(tp)
        if isinstance(value, str):
            value = [item.strip() for item in value.strip("[]").split(",") if item.strip()]
            if args and args[0] is not str:
                value = [parse_value(item, f"{name}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{name}={value!r} must be {_type_name(tp)}")
        return [coerce(f"{name}[{i}]", item, args[0]) for i, item in enumerate(value)] if args else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be an integer")
        given = value  # named as written: 1e30 as a float, not its integer 1000000000000000019884624838656
        if isinstance(value, numbers.Integral):  # numpy's integers too, kept as Python ints (JSON writes those)
            value = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, float):  # numpy's float32 (128.0): as a float
            value = float(value)
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise ConfigError(f"{name}={value!r} must be an integer")
        if abs(value) > MAX_INT:
            raise OutOfRange(f"{name}={given!r} is out of range (at most 2**63 - 1)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # (numpy's numbers are Real)
            raise ConfigError(f"{name}={value!r} must be a number")
        try:
            number = float(value)
        except OverflowError:  # an integer past a float's range (400 digits in a JSON file or --set)
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{name}={value!r} must be a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r} must be a string")
    if tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{name}={value!r} must be a mapping")
    # (a field declared otherwise was taken unchecked: Literal["a", "b"] took any value, a tuple field took 7)
    declared = tp.__name__ if isinstance(tp, type) else tp
    raise TypeError(f"{name}: its declared type {declared} is not one gbattn's configs check: declare it bool, int, "
                    f"float, str, dict or list[...], each optionally | None (a choice of words: a str field with "
                    f"field(metadata=one_of(...)))")


class OutOfRange(ConfigError):
    """An integer past what a 64-bit integer holds (tensors and JSON readers take no more)."""


def is_count(value: Any) -> bool:
    """An integer >= 1, numpy's integers included; a bool or a float (2.0) is none: the rule of a Python API's counts
    (a cache's rows, a loss chunk), stricter than a config field's, which takes the 2.0 a JSON file may hold."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def checked(name: str, value: Any, tp, ok: Callable[[Any], bool] | None, rule: str) -> Any:
    """``value`` as type ``tp`` (:func:`coerce`) when ``ok`` (None: any value) of it holds, else a ConfigError saying
    ``name=value must be rule``: a keyword argument outside a config (generate's options, the HF model's)
    checked by the rules config fields follow."""
    try:
        number = coerce(name, value, tp)
    except OutOfRange:  # (its own words: top_k=2**63 "must be an integer >= 1" named a rule the value meets)
        raise
    except ConfigError:
        number = None
    if number is None or (ok is not None and not ok(number)):
        raise ConfigError(f"{name}={value!r} must be {rule}")
    return number


class Typed:
    """Base of the config dataclasses: fields coerced and range-checked on construction, a JSON
    round trip, and ``replace``. Subclasses may add cross-field checks in ``validate``."""

    kind = "config"  # how error messages name this record
    prefix = ""  # prepended to field names in error messages (e.g. "attn.")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            name = self.prefix + f.name
            value = coerce(name, getattr(self, f.name), hints[f.name])
            if value is not None and "check" in f.metadata:
                f.metadata["check"](name, value)
            object.__setattr__(self, f.name, value)
        self.validate()

    def validate(self) -> None:
        """Checks that involve several fields (override)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict):
        if not isinstance(d, dict):
            raise ConfigError(f"a {cls.kind} must be a mapping, got {type(d).__name__}")
        known = set(cls.field_names())
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.kind} field(s) {unknown}{did_you_mean(unknown, sorted(known))}; "
                              f"allowed: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **changes: Any):
        return type(self).from_dict({**self.to_dict(), **changes})
