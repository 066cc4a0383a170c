"""Per-module tier overrides: module-name patterns -> the tier that module's state lives in.

A pattern is a dotted module path whose segments are names, `*` (any one segment), or a
name with an index range into a ModuleList: `model.layers[0-2]` (layers 0, 1, 2),
`model.layers[3-]` (3 and up), `model.layers[5]`. A pattern applies to the module it
names and to everything inside it; where several apply, the most specific (the one
naming the deepest module) wins, and two equally specific ones that disagree are an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from tierstack.errors import ConfigError
from tierstack.tiers import TIERS

_SEGMENT = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*|\*)(?:\[(?P<lo>\d+)(?P<dash>-)?(?P<hi>\d+)?\])?$")


@dataclass(frozen=True)
class _Step:
    """One segment to match: a name (or '*'), or an index range lo..hi (hi None: open)."""

    name: str | None = None
    lo: int | None = None
    hi: int | None = None

    def matches(self, segment: str) -> bool:
        if self.name is not None:
            return self.name == "*" or self.name == segment
        if not segment.isdigit():
            return False
        index = int(segment)
        return index >= self.lo and (self.hi is None or index <= self.hi)


def _parse(pattern: str, key: str) -> tuple[_Step, ...]:
    steps: list[_Step] = []
    for part in pattern.split("."):
        m = _SEGMENT.match(part)
        if not m:
            raise ConfigError(
                f"{key}: cannot read module pattern {pattern!r} at {part!r}; write dotted "
                f"module names, '*' for any one, and [a-b], [a-] or [a] for ModuleList indices")
        steps.append(_Step(name=m.group("name")))
        if m.group("lo") is not None:
            lo = int(m.group("lo"))
            hi = None if m.group("dash") and m.group("hi") is None else int(m.group("hi") or lo)
            if hi is not None and hi < lo:
                raise ConfigError(f"{key}: index range [{lo}-{hi}] in {pattern!r} is empty")
            steps.append(_Step(lo=lo, hi=hi))
    return tuple(steps)


class ModuleTiers:
    """Resolves module names to tiers by the configured overrides."""

    def __init__(self, overrides: dict[str, str], key: str = "train.tier_overrides") -> None:
        self._rules: list[tuple[str, tuple[_Step, ...], str]] = []
        for pattern, tier in overrides.items():
            where = f"{key}[{pattern!r}]"
            if tier not in TIERS:
                raise ConfigError(f"{where}: tier {tier!r} is not one of {', '.join(TIERS)}")
            self._rules.append((pattern, _parse(pattern, where), tier))

    def check_matches(self, module_names: Iterable[str]) -> None:
        """Refuse a pattern that names no module of the model (a typo, or another model's
        names: `encoder.layer[0-2]` on a GPT), listing the names there are."""
        names = [n for n in module_names if n]
        for pattern, steps, _ in self._rules:
            if not any(_names(steps, n.split(".")) for n in names):
                raise ConfigError(
                    f"train.tier_overrides[{pattern!r}] names no module of this model; its "
                    f"modules are: {', '.join(summarize_names(names))}")

    def tier_for(self, module_name: str) -> str | None:
        """The tier the overrides give `module_name`, or None when none applies."""
        segments = module_name.split(".") if module_name else []
        best: list[tuple[int, str, str]] = []
        for pattern, steps, tier in self._rules:
            if len(steps) <= len(segments) and all(s.matches(seg) for s, seg in zip(steps, segments)):
                best.append((len(steps), pattern, tier))
        if not best:
            return None
        depth = max(d for d, _, _ in best)
        winners = {(p, t) for d, p, t in best if d == depth}
        if len({t for _, t in winners}) > 1:
            names = " and ".join(sorted(repr(p) for p, _ in winners))
            raise ConfigError(
                f"train.tier_overrides: {names} both apply to module {module_name!r} with "
                f"different tiers; make one of them more specific")
        return next(iter(winners))[1]


def _names(steps: tuple[_Step, ...], segments: list[str]) -> bool:
    """Whether the pattern `steps` names the module with these segments (not a parent)."""
    return len(steps) == len(segments) and all(s.matches(seg) for s, seg in zip(steps, segments))


def summarize_names(names: Iterable[str]) -> list[str]:
    """Module names in pattern syntax with ModuleList indices folded into ranges, in
    first-seen order: blocks.0.ln1 ... blocks.7.ln1 -> blocks[0-7].ln1."""
    groups: dict[str, list[set[int]]] = {}
    for name in names:
        shape, indices = [], []
        for seg in name.split("."):
            if seg.isdigit():
                shape.append("[]")
                indices.append(int(seg))
            else:
                shape.append(("." if shape else "") + seg)
        key = "".join(shape)
        seen = groups.setdefault(key, [set() for _ in indices])
        for position, index in enumerate(indices):
            seen[position].add(index)
    out = []
    for key, seen in groups.items():
        parts = key.split("[]")
        text = parts[0]
        for position, rest in enumerate(parts[1:]):
            values = sorted(seen[position])
            span = (f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}"
                    if values[-1] - values[0] + 1 == len(values) else ",".join(map(str, values)))
            text += f"[{span}]{rest}"
        out.append(text)
    return out
