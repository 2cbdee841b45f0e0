"""Method parameters, declared once: the keyword-only parameters of a method's ``fuse``.

A method declares each parameter in its ``fuse`` signature, with its type and default,
and describes it with :class:`Param` inside ``typing.Annotated``::

    def fuse(self, checkpoints, specs, *,
             sweeps: Annotated[int, Param(help="refinement sweeps", minimum=0,
                                          maximum=1000)] = 5,
             backend: Annotated[str, Param(help="matching kernels",
                                           choices=("core", "numpy"))] = "core",
             ) -> FusionResult: ...

:func:`method_params` reads that declaration back as :class:`ParamSpec` objects, from
which the CLI builds its options, :func:`validate` checks values at the API edge and
:func:`parameter_reference` writes the docs' table. A plain keyword-only parameter (no
``Param``) is still a parameter: its type and default come from the signature.

Types understood: ``int``, ``float``, ``bool``, ``str``, ``pathlib.Path``, each optionally
``| None`` (an unannotated parameter takes its default's type); ``float | Sequence[float]``
(one value, or one per client, given in the order of the inputs); ``int | Sequence[int] |
str`` (one value, one per layer, or one of the ``choices`` words; on the command line
``N``, ``N1,N2`` or the word); any other type (a
callable such as an activation provider, or ``Any``) is passed through the Python API only
and checked with ``callable``/``isinstance``.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusekit.core.errors import ParameterError

#: Kinds a front door can spell as text (the CLI builds options for these).
TEXT_KINDS = ("int", "float", "bool", "str", "path", "floats", "ints")


@dataclass(frozen=True)
class Param:
    """How a method parameter is described and bounded (the type lives in the signature).

    Attributes:
        help: one sentence for ``--help`` and the docs.
        paper: where the parameter comes from (paper, equation), for the docs.
        choices: the accepted values of a ``str`` parameter.
        minimum: smallest accepted value (inclusive); for ``floats``, of every entry.
        maximum: largest accepted value (inclusive).
        above: values must be strictly greater than this.
        default_text: what the default means when it is ``None`` (e.g. "most samples").
        flags: extra CLI spellings besides ``--<name-with-dashes>`` (e.g. ``--lambda``).
    """

    help: str = ""
    paper: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    default_text: str | None = None
    flags: tuple[str, ...] = ()


#: ``device``, declared once for every method that takes it: where the engine's cost matrices
#: (and distill's training) are computed (:func:`fusekit.methods.base.places_cost_kernels`).
Device = typing.Annotated[str, Param(
    help="auto (CUDA when present; cost matrices only when large enough to gain), cpu or "
    "cuda[:N]")]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of one method, read from its ``fuse`` signature.

    ``kind`` is one of int, float, bool, str, path, floats (one value or one per client),
    ints (one integer, one per layer, or a word from ``choices``), or object (anything
    else; ``type`` is then the class or callable type to check).
    """

    name: str
    kind: str
    default: Any
    optional: bool
    param: Param
    type: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def per_client(self) -> bool:
        return self.kind == "floats"

    def describe_default(self) -> str:
        """The default as the CLI and the docs show it."""
        if self.default is None:
            return self.param.default_text or "none"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)

    def describe_bounds(self) -> str:
        p = self.param
        parts = []
        if p.above is not None:
            parts.append(f"> {p.above:g}")
        if p.minimum is not None:
            parts.append(f">= {p.minimum:g}")
        if p.maximum is not None:
            parts.append(f"<= {p.maximum:g}")
        return ", ".join(parts)

    def expected(self) -> str:
        """What a valid value looks like, for error messages."""
        what = {
            "int": "an integer",
            "float": "a finite number",
            "bool": "a bool (True or False)",
            "str": "a string",
            "path": "a path",
            "floats": "a finite number",
            "ints": "an integer",
            "object": _object_name(self.type),
        }[self.kind]
        if self.param.choices and self.kind != "ints":
            what = "one of " + ", ".join(repr(c) for c in self.param.choices)
        bounds = self.describe_bounds()
        if bounds:
            what += f" {bounds}"
        if self.per_client:
            what += ", or one such number per client"
        if self.kind == "ints":
            what += ", a list of them (one per layer)"
            what += "".join(f", or {c!r}" for c in self.param.choices or ())
        if self.optional:
            what += ", or None"
        return what

    def to_json(self) -> dict[str, Any]:
        """The declaration as JSON, for forms built from it (the service's web page)."""
        p = self.param
        return {"name": self.name, "kind": self.kind, "optional": self.optional,
                "default": self.default if self.kind in TEXT_KINDS else None,
                "default_text": self.describe_default(), "help": p.help, "paper": p.paper,
                "choices": list(p.choices) if p.choices is not None else None,
                "minimum": p.minimum, "maximum": p.maximum, "above": p.above,
                "expected": self.expected()}


def method_params(method: Any) -> list[ParamSpec]:
    """The declared parameters of a method (class or instance), in signature order."""
    fuse = method.fuse
    return list(_declared(getattr(fuse, "__func__", fuse)))


@functools.cache
def _declared(fuse: Any) -> tuple[ParamSpec, ...]:
    """The keyword-only parameters of one ``fuse`` function, read once: reading type hints
    and the signature takes about 0.4 ms, which every ``fusekit.fuse`` call would pay."""
    hints = typing.get_type_hints(fuse, include_extras=True)
    specs = []
    for p in inspect.signature(fuse).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        default = None if p.default is inspect.Parameter.empty else p.default
        annotation = hints.get(p.name, type(default) if default is not None else Any)
        specs.append(_read(p.name, annotation, default))
    return tuple(specs)


def _read(name: str, annotation: Any, default: Any) -> ParamSpec:
    param = Param()
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extras = typing.get_args(annotation)
        param = next((e for e in extras if isinstance(e, Param)), param)
    members = _union_members(annotation)
    optional = type(None) in members or default is None
    members = [m for m in members if m is not type(None)]
    kind, cls = _kind(members)
    return ParamSpec(name=name, kind=kind, default=default, optional=optional, param=param,
                     type=cls)


def _union_members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _kind(members: list[Any]) -> tuple[str, Any]:
    simple = {int: "int", float: "float", bool: "bool", str: "str", Path: "path"}
    if len(members) == 1 and members[0] in simple:
        return simple[members[0]], members[0]
    if float in members and any(_is_sequence_of(m, float) for m in members):
        return "floats", float
    if int in members and str in members and any(_is_sequence_of(m, int) for m in members):
        return "ints", int
    origins = {typing.get_origin(m) or m for m in members}
    if str in origins and (os.PathLike in origins or Path in origins):
        return "path", Path
    return "object", members[0] if len(members) == 1 else None


def _is_sequence_of(annotation: Any, item: type) -> bool:
    origin = typing.get_origin(annotation)
    return (origin in (collections.abc.Sequence, list, tuple)
            and typing.get_args(annotation)[:1] == (item,))


def validate(method_name: str, specs: list[ParamSpec], values: dict[str, Any]) -> None:
    """Refuse unknown names, wrong types, values outside choices and bounds.

    Raises:
        ParameterError: naming the parameter, what was expected and what was found.
    """
    known = {s.name: s for s in specs}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ParameterError(
            f"method {method_name!r} does not take parameter(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(known) or 'none'}"
        ).naming(*unknown, *known)
    for name, value in values.items():
        check_value(known[name], value)


def check_value(spec: ParamSpec, value: Any) -> None:
    """One value against its declaration (see :func:`validate`)."""
    if value is None and spec.optional:
        return
    scalar = {"floats": "float", "ints": "int"}.get(spec.kind, spec.kind)
    if spec.kind == "ints" and isinstance(value, str):
        if value not in (spec.param.choices or ()):
            _refuse(spec, value)
        return
    if spec.kind in ("floats", "ints") and _is_list(value):
        if len(value) == 0:
            _refuse(spec, value)
        for entry in value:
            _check_scalar(spec, entry, scalar, value)
        return
    _check_scalar(spec, value, scalar, value)


def from_text(spec: ParamSpec, text: str) -> Any:
    """An ``ints`` value as a command line or a recipe spells it: ``N``, ``N1,N2`` or a word.

    Raises:
        ParameterError: anything else.
    """
    if text in (spec.param.choices or ()):
        return text
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        _refuse(spec, text)
    return values[0] if len(values) == 1 else values


def _check_scalar(spec: ParamSpec, value: Any, kind: str, whole: Any) -> None:
    if not _has_kind(value, kind, spec.type):
        _refuse(spec, whole)
    if kind == "str" and spec.param.choices is not None and value not in spec.param.choices:
        _refuse(spec, whole)
    if kind in ("int", "float") and not _in_bounds(spec.param, value):
        _refuse(spec, whole)


def _has_kind(value: Any, kind: str, cls: Any) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, numbers.Integral)
    if kind == "float":
        return isinstance(value, numbers.Real) and math.isfinite(value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "path":
        return isinstance(value, (str, os.PathLike))
    if cls is Any:
        return True
    if isinstance(cls, type) and cls is not collections.abc.Callable:
        return isinstance(value, cls)
    return callable(value)


def _in_bounds(param: Param, value: float) -> bool:
    return not ((param.minimum is not None and value < param.minimum)
                or (param.maximum is not None and value > param.maximum)
                or (param.above is not None and value <= param.above))


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (
        hasattr(value, "ndim") and hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1)


def _object_name(cls: Any) -> str:
    if cls is Any:
        return "any value"
    if typing.get_origin(cls) is collections.abc.Callable or cls is None:
        return "a callable"
    return f"a {getattr(cls, '__name__', cls)}"


def _refuse(spec: ParamSpec, value: Any) -> None:
    if getattr(value, "ndim", 0):
        found = f"{type(value).__name__} of shape {tuple(value.shape)}"
    else:
        shown = repr(value)
        found = f"{shown[:60]}{'...' if len(shown) > 60 else ''} ({type(value).__name__})"
    raise ParameterError(f"{spec.name}: expected {spec.expected()}, found {found}"
                         ).naming(spec.name)


def parameter_reference(methods: dict[str, Any]) -> str:
    """The Markdown parameter reference of every registered method (docs/PARAMETERS.md)."""
    lines = [
        "# Fusion parameters",
        "",
        "Generated from the methods' declarations by "
        "`python -m fusekit.methods > docs/PARAMETERS.md`; a test checks it is current.",
        "The same names work as `fusekit fuse` options (`--width-ratio`) and as keyword",
        "arguments of `fusekit.fuse(..., width_ratio=...)`.",
    ]
    for name in sorted(methods):
        cls = methods[name]
        lines += ["", f"## {name}", "", cls.summary[:1].upper() + cls.summary[1:] + ".", ""]
        specs = method_params(cls)
        if not specs:
            lines.append("No parameters.")
            continue
        lines += ["| parameter | CLI option | type | default | accepted | description | source |",
                  "|---|---|---|---|---|---|---|"]
        for s in specs:
            option = " ".join([s.flag, *s.param.flags]) if s.kind in TEXT_KINDS else "Python only"
            accepted = ", ".join(filter(None, [*(s.param.choices or ()), s.describe_bounds()]))
            cells = [f"`{s.name}`", f"`{option}`", _type_name(s), s.describe_default(),
                     accepted or "", s.param.help, s.param.paper or ""]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _type_name(spec: ParamSpec) -> str:
    name = {"floats": "float, or one float per client",
            "ints": "int, one int per layer, or " + " or ".join(spec.param.choices or ()),
            "object": _object_name(spec.type).removeprefix("a ")}.get(spec.kind, spec.kind)
    return name + (" or None" if spec.optional and spec.default is None else "")

