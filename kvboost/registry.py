"""One generic registry; every plugin family owns one instance.

A plugin is registered by name with a decorator::

    from kvboost.registry import RECOMPUTE

    @RECOMPUTE.register("my_strategy")
    class MyStrategy(RecomputeStrategy):
        def score(self, view): ...

and built from a config (Hydra yaml or plain dict) whose ``name`` is the registry key and whose other
fields are the constructor's keyword arguments::

    RECOMPUTE.build({"name": "my_strategy", "ratio": 0.15})

Third-party packages register plugins through the entry-point group ``kvboost.plugins``: each entry
point names a module (or a callable) that is imported (called) once, the first time any registry is
asked for a name it does not know or for its list of names. Their yaml (``<package>/configs/<group>/<name>.yaml``)
is found by Hydra through ``hydra_plugins/kvboost_searchpath`` (no ``hydra.searchpath`` needed).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

ENTRY_POINT_GROUP = "kvboost.plugins"
#: how a plugin from another package is found, said by UnknownPluginError (README: "Writing a strategy as your own
#: package"); the configs half is hydra_plugins/kvboost_searchpath
PLUGIN_HINT = (
    "A plugin from your own package is found when the package is installed with a kvboost.plugins entry point "
    "naming the module that registers it; run.py, sweeps and the compose API find its yaml, with no flag, in "
    "<package>/configs/<group>/<name>.yaml (or the folder a kvboost.configs entry point names)."
)


class UnknownPluginError(KeyError):
    """Raised when a plugin name is not registered; the message lists the registered names."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnknownFieldError(ValueError, TypeError):
    """A plugin config names a field its plugin does not take; the message lists the accepted ones. Both a
    ValueError (a bad config) and a TypeError (what the constructor itself would have raised)."""


class Registry(Generic[T]):
    """Name -> factory mapping for one plugin family.

    Args:
        family: human-readable family name used in error messages (e.g. ``"recompute"``).
        builtin_modules: modules imported lazily before the first lookup so that the family's
            built-in members are registered without import cycles; ``"package.*"`` imports every module of
            ``package`` (an in-tree plugin is then one module, named nowhere else).
        build_to_validate: the family's plugins are cheap to construct and touch nothing outside themselves
            (no files, sockets, devices), so :meth:`validate` constructs them to run their value checks.
    """

    def __init__(self, family: str, builtin_modules: tuple[str, ...] = (), *, build_to_validate: bool = False) -> None:
        self.family = family
        self._builtin_modules = builtin_modules
        #: plugins cheap and side-effect free to construct: validate() builds them, so value checks
        #: (``recompute.ratio=1.5``) fail at compose time, before any model loads
        self.build_to_validate = build_to_validate
        self._factories: dict[str, Callable[..., T]] = {}
        self._loaded = False

    # ------------------------------------------------------------------ registration
    def register(self, name: str, *, override: bool = False) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering a class or factory function under ``name``."""
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.family}: plugin name must be a non-empty string, got {name!r}")

        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            existing = self._factories.get(name)
            if existing is not None and existing is not factory and not override:
                raise ValueError(
                    f"{self.family}: name {name!r} is already registered to {existing!r}; "
                    "pass override=True to replace it"
                )
            self._factories[name] = factory
            # Let instances know their own registry key (used in fingerprints and results).
            try:
                factory.registry_name = name  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            return factory

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests use it to clean up deliberately broken plugins)."""
        self._factories.pop(name, None)

    # ------------------------------------------------------------------ lookup
    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self._builtin_modules:
            for name in _expand(module):
                importlib.import_module(name)
        load_entry_point_plugins()

    def names(self) -> list[str]:
        """Sorted list of registered names (built-ins and entry-point plugins)."""
        self._ensure_loaded()
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._factories

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered under ``name``; raises UnknownPluginError listing the known names."""
        self._ensure_loaded()
        try:
            return self._factories[name]
        except KeyError:
            failed = "".join(f"\n  plugin entry point {ep!r} failed to load: {error}" for ep, error in
                             _entry_point_failures.items())  # fmt: skip
            raise UnknownPluginError(
                f"unknown {self.family} plugin {name!r}; registered {self.family} plugins: "
                f"{', '.join(sorted(self._factories)) or '(none)'}{failed}\n{PLUGIN_HINT}"
            ) from None

    def build(self, spec: str | Mapping[str, Any] | T | None, **overrides: Any) -> T:
        """Instantiate a plugin from a name, a config mapping with ``name``, or pass an instance through.

        Mapping keys other than ``name`` (and Hydra's ``_target_``-free extras such as ``description``)
        become constructor keyword arguments.
        """
        if spec is None:
            raise ValueError(f"{self.family}: no plugin given; registered: {', '.join(self.names())}")
        if isinstance(spec, str):
            self.check_fields(spec, overrides)  # from Python the keywords are the config's fields
            return self.get(spec)(**overrides)
        if isinstance(spec, Mapping) or _is_omegaconf(spec):
            cfg = _to_plain_dict(spec)
            if "name" not in cfg:
                raise ValueError(
                    f"{self.family} config needs a 'name' (one of: {', '.join(self.names())}); got keys {sorted(cfg)}"
                )
            name = cfg.pop("name")
            cfg.pop("description", None)
            cfg.update(overrides)
            factory = self.get(name)
            self.check_fields(name, cfg)  # a typo lists the accepted fields, from Python as from the CLI
            try:
                return factory(**cfg)
            except TypeError as exc:
                raise TypeError(f"{self.family} plugin {name!r} rejected its config {cfg}: {exc}") from exc
        return spec  # already an instance

    def validate(self, spec: str | Mapping[str, Any] | Any, *, provided: tuple[str, ...] = ()) -> None:
        """Check a config without building it: the name is registered and every field is an argument.

        A factory with a ``config_class`` dataclass attribute is checked against that dataclass's fields, and the
        dataclass is built from them (so its ``__post_init__`` value checks run too);
        otherwise against the factory's signature. ``provided`` names arguments the caller passes itself.
        In a family made with ``build_to_validate`` the plugin is then built and dropped, so its constructor's
        value checks run too (``recompute.ratio=1.5``).
        Raises UnknownPluginError or ValueError naming the field, so a typo in a config fails at start-up.
        """
        if spec is None or not (isinstance(spec, (str, Mapping)) or _is_omegaconf(spec)):
            return  # None is refused by build(); an instance is not a config
        cfg = {} if isinstance(spec, str) else _to_plain_dict(spec)
        name = spec if isinstance(spec, str) else cfg.pop("name", None)
        if name is None:
            raise ValueError(f"{self.family} config needs a 'name' (one of: {', '.join(self.names())})")
        cfg.pop("description", None)
        self.check_fields(name, cfg, provided=provided)
        factory = self.get(name)
        config_class = getattr(factory, "config_class", None)
        if config_class is not None and dataclasses.is_dataclass(config_class):
            accepted = [f.name for f in dataclasses.fields(config_class)]
            config_class(**{k: v for k, v in cfg.items() if k in accepted})  # its own value checks (__post_init__)
        elif self.build_to_validate and not provided:
            try:
                factory(**cfg)  # the constructor's value checks (a ratio outside [0, 1]...)
            except TypeError as exc:
                if "required" in str(exc):  # needs arguments only its caller gives: nothing more to check here
                    return
                raise ValueError(f"{self.family} plugin {name!r}: {exc}") from exc

    def accepted_fields(self, name: str) -> tuple[list[str], str] | None:
        """``(fields, kind)`` plugin ``name`` accepts: its ``config_class`` dataclass's fields plus the keyword
        arguments its factory names (kind ``"field"``), else the factory's keyword arguments (``"argument"``); None
        when it takes ``**kwargs`` without a ``config_class`` or has no inspectable signature."""
        factory = self.get(name)
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):  # builtins without a signature: nothing to check
            params = None
        named = [p for p, v in (params or {}).items() if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
        config_class = getattr(factory, "config_class", None)
        if config_class is not None and dataclasses.is_dataclass(config_class):
            fields = [f.name for f in dataclasses.fields(config_class)]
            return fields + [p for p in named if p not in fields], "field"
        if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        return named, "argument"

    def check_fields(self, name: str, fields: Mapping[str, Any] | Any, *, provided: tuple[str, ...] = ()) -> None:
        """UnknownFieldError naming the unknown fields of plugin ``name`` and listing the accepted ones."""
        found = self.accepted_fields(name)
        if found is None:
            return
        accepted, kind = found
        unknown = sorted(set(fields) - set(accepted) - set(provided))
        if unknown:
            shown = [a for a in accepted if a not in provided]
            raise UnknownFieldError(f"{self.family} plugin {name!r}: unknown {kind}(s) {unknown}; "
                             f"accepted: {', '.join(shown) or '(none)'}")  # fmt: skip

    def __repr__(self) -> str:
        """The family and every registered name, entry-point plugins included (loading them first)."""
        return f"Registry({self.family!r}, {self.names()})"


def _expand(module: str) -> list[str]:
    """``module``, or for ``"package.*"`` every module of ``package`` (sorted, private ones too: a helper module
    registers nothing)."""
    if not module.endswith(".*"):
        return [module]
    package = importlib.import_module(module[:-2])
    return [f"{package.__name__}.{info.name}" for info in sorted(pkgutil.iter_modules(package.__path__),
                                                                   key=lambda info: info.name)]  # fmt: skip


def _is_omegaconf(obj: Any) -> bool:
    return type(obj).__module__.startswith("omegaconf")


def _to_plain_dict(spec: Any) -> dict[str, Any]:
    if _is_omegaconf(spec):
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(spec, resolve=True))  # type: ignore[arg-type]
    return dict(spec)


_entry_points_loaded = False
#: entry point name -> "ExceptionType: message" of the plugins whose import failed (named by UnknownPluginError, so a
#: user who asks for a plugin from a broken package sees why it is missing, not only the list of built-ins)
_entry_point_failures: dict[str, str] = {}


def load_entry_point_plugins() -> None:
    """Import every ``kvboost.plugins`` entry point once (modules register on import)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                obj()
        except Exception as exc:  # a broken third-party plugin must not break the built-ins
            log.warning("kvboost: plugin entry point %r failed to load: %s", ep.name, exc)
            _entry_point_failures[ep.name] = f"{type(exc).__name__}: {exc}"


CHUNKERS: Registry[Any] = Registry("chunker", ("kvboost.chunking",), build_to_validate=True)
HASHERS: Registry[Any] = Registry("hasher", ("kvboost.hashing",), build_to_validate=True)
CACHE_TIERS: Registry[Any] = Registry("cache tier", ("kvboost.cache",))
EVICTION: Registry[Any] = Registry("eviction", ("kvboost.cache",), build_to_validate=True)
RECOMPUTE: Registry[Any] = Registry("recompute", ("kvboost.recompute.*",), build_to_validate=True)
KV_QUANT: Registry[Any] = Registry("kv quant", ("kvboost.quant",), build_to_validate=True)
ATTENTION: Registry[Any] = Registry("attention", ("kvboost.attention",))
DRAFT: Registry[Any] = Registry("draft", ("kvboost.speculative",))

ALL_REGISTRIES: dict[str, Registry[Any]] = {
    "chunker": CHUNKERS,
    "hasher": HASHERS,
    "cache": CACHE_TIERS,
    "eviction": EVICTION,
    "recompute": RECOMPUTE,
    "quant": KV_QUANT,
    "attn": ATTENTION,
    "speculative": DRAFT,
}
