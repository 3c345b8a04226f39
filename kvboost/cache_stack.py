"""A stack of cache tiers from the command line, for ``run.py`` and ``kvboost-server`` alike.

Hydra reads ``cache=[memory,disk]`` as a list of options of the ``cache`` group and *merges* them into one tier
(a disk tier), and ``cache=[{name: memory, capacity: 1GiB}, {name: disk, path: /data/kv}]`` fails inside Hydra
(``TypeError: can only concatenate str (not "dict") to str``). Both mean a stack of tiers, fastest first, so both
commands take these overrides out before Hydra sees them (:func:`split_cache_overrides`) and put the stack into
the composed config afterwards (:func:`cache_stack`):

- ``cache=[memory,disk]``: each name's ``kvboost/configs/cache/<name>.yaml``;
- ``cache=[{name: memory, capacity: 1GiB}, {name: disk, path: /data/kv}]``: each mapping over its name's yaml;
- ``cache.1.path=/data/kv``: one field of one tier of the stack (index from 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvboost.paths import CONFIG_DIR


class CacheOverrideError(ValueError):
    """A cache override no stack of tiers can be made from (reported before anything is loaded)."""


@dataclass
class CacheStackSpec:
    """The cache overrides taken out of a command line: the tiers, and fields set per tier index."""

    tiers: list[str | dict[str, Any]] | None = None
    fields: list[tuple[str, Any]] = field(default_factory=list)  # ("cache.1.path", "/data/kv")
    overrides: list[str] = field(default_factory=list)  # the command-line text, for the run's record

    def __bool__(self) -> bool:
        return self.tiers is not None or bool(self.fields)


def _parse(override: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(override)
    except Exception:  # not an override Hydra can read: leave it to Hydra, which reports it
        return None


def tier_list(value: str) -> list[str | dict[str, Any]] | None:
    """``[memory,disk]`` -> ``["memory", "disk"]``; ``[{name: memory, ...}, ...]`` -> the mappings; None for a
    value that is not a list (one tier: Hydra's own group override)."""
    parsed = _parse(f"cache={value.strip()}")
    if parsed is None or parsed.is_sweep_override():
        return None
    tiers = parsed.value()
    if not isinstance(tiers, list):
        return None
    if not tiers:
        raise CacheOverrideError("cache=[]: a stack needs at least one tier, e.g. cache=[memory,disk]")
    for tier in tiers:
        if not (isinstance(tier, str) or (isinstance(tier, dict) and isinstance(tier.get("name"), str))):
            raise CacheOverrideError(
                f"cache={value}: each tier is a name (cache=[memory,disk]) or a mapping with a name "
                f"(cache=[{{name: memory, capacity: 1GiB}}]); got {tier!r}"
            )
    return tiers


def _is_tier_field(key: str) -> bool:
    parts = key.split(".")
    return len(parts) >= 3 and parts[0] == "cache" and parts[1].isdigit()


def split_cache_overrides(overrides: list[str]) -> tuple[list[str], CacheStackSpec]:
    """Split command-line overrides into (what Hydra composes, the cache stack to put in afterwards).

    Only ``cache=[...]`` and ``cache.<index>.<field>=value`` are taken; everything else (``cache=disk``,
    ``cache.capacity=1GiB``, flags) is returned unchanged, in order.
    """
    rest: list[str] = []
    spec = CacheStackSpec()
    for override in overrides:
        parsed = _parse(override) if override.lstrip("+~").startswith("cache") else None
        key = parsed.key_or_group if parsed is not None else None
        if key == "cache" and not parsed.is_delete():
            value = override.split("=", 1)[1] if "=" in override else ""
            tiers = tier_list(value)
            if tiers is not None:
                spec.tiers = tiers
                spec.overrides.append(override)
                continue
        elif key is not None and _is_tier_field(key):
            if parsed.is_sweep_override():
                raise CacheOverrideError(f"{override!r}: a field of one tier cannot be swept")
            spec.fields.append((key, parsed.value()))
            spec.overrides.append(override)
            continue
        rest.append(override)
    return rest, spec


def tier_defaults(name: str, config_dir: Path = CONFIG_DIR) -> dict[str, Any]:
    """The fields of ``kvboost/configs/cache/<name>.yaml``; CacheOverrideError listing the tiers when there is none."""
    from omegaconf import OmegaConf

    path = config_dir / "cache" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (config_dir / "cache").glob("*.yaml"))
        raise CacheOverrideError(f"cache tier {name!r} has no config; tiers: {', '.join(known) or '(none)'}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def cache_stack(spec: CacheStackSpec, config_dir: Path = CONFIG_DIR) -> list[dict[str, Any]]:
    """The list of tier configs ``spec`` describes (each tier's yaml, then its mapping, then its indexed fields).

    Raises CacheOverrideError for indexed fields without a stack or for an index past the stack's end.
    """
    if spec.tiers is None:
        key = spec.fields[0][0] if spec.fields else "cache.N.field"
        raise CacheOverrideError(f"{key}: indexed cache fields need a stack of tiers (cache=[memory,disk])")
    stack: list[dict[str, Any]] = []
    for tier in spec.tiers:
        given = {"name": tier} if isinstance(tier, str) else dict(tier)
        stack.append({**tier_defaults(given["name"], config_dir), **given})
    for key, value in spec.fields:
        _, index, *path = key.split(".")
        if int(index) >= len(stack):
            raise CacheOverrideError(f"{key}: the stack has {len(stack)} tier(s), indexed from 0")
        target = stack[int(index)]
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    return stack


def apply_cache_stack(cfg: Any, spec: CacheStackSpec, config_dir: Path = CONFIG_DIR) -> Any:
    """Put the stack ``spec`` describes into ``cfg.cache`` (an OmegaConf config or a dict); returns ``cfg``."""
    if not spec:
        return cfg
    stack = cache_stack(spec, config_dir)
    if isinstance(cfg, dict):
        cfg["cache"] = stack
        return cfg
    from omegaconf import OmegaConf

    OmegaConf.set_struct(cfg, False)
    cfg.cache = OmegaConf.create(stack)
    return cfg
