"""One registry for models, datasets and the Cells a keep-list may name (after timm's `_registry.py`).

Registries live here, outside the packages they fill, so registering a model imports this module and not
`ampzoo/models/__init__.py`:

    from ampzoo.registry import MODELS

    @MODELS.register()                       # key: the function's name; or .register("name", task=...)
    def lenet5(num_classes=10): ...

`MODELS.get("lenet5")` returns it or raises ConfigError with the close matches; `MODELS.meta(name)` gives
what was registered with it (a dataset's `task`).

A name is registered once: a plugin that registers `lenet5` again would replace the shipped model in every
recipe, so it is one error line unless it says `@MODELS.register("lenet5", override=True)`, which the run's
description then names (`MODELS.overridden`).
"""
from typing import Any, Callable, Dict, List, Optional

from ampzoo.errors import ConfigError, choices_hint


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._items: Dict[str, Any] = {}
        self._meta: Dict[str, Dict[str, Any]] = {}
        self.missing_hint: Optional[Callable[[], str]] = None  # what an unknown name's error adds (MODELS: plugins)
        self.overridden: Dict[str, str] = {}  # name: what replaced the one registered first (override=True)

    def register(self, name: Optional[str] = None, override: bool = False, **meta) -> Callable:
        """Decorator: register under `name` (default: the function's or class's own name) with metadata;
        `override=True` replaces what is registered under that name already (otherwise an error)."""
        def wrap(obj):
            self.add(name or obj.__name__, obj, override=override, **meta)
            return obj
        return wrap

    def add(self, name: str, obj, override: bool = False, **meta) -> None:
        before = self._items.get(name)
        if before is not None and _where(before) != _where(obj):  # the same code imported again is no clash
            if not override:
                raise ConfigError(f"{_where(obj)} registers the {self.kind} name {name!r}, which {_where(before)} "
                                  f"has: it would replace that {self.kind} everywhere it is named; register yours "
                                  f"under another name, or with .register({name!r}, override=True) to replace it")
            self.overridden[name] = _where(obj)
        self._items[name] = obj
        self._meta[name] = meta

    def remove(self, name: str) -> None:
        self._items.pop(name, None)
        self._meta.pop(name, None)

    def get(self, name: str, key: str = ""):
        if name not in self._items:
            where = f"{key}={name!r}" if key else repr(name)
            hint = f"; {self.missing_hint()}" if self.missing_hint else ""
            raise ConfigError(f"{where} is not a registered {self.kind}; " + choices_hint(name, self._items) + hint)
        return self._items[name]

    def meta(self, name: str) -> Dict[str, Any]:
        self.get(name)
        return self._meta[name]

    def names(self) -> List[str]:
        return sorted(self._items)

    def __contains__(self, name) -> bool:
        return name in self._items

    def __iter__(self):
        return iter(self.names())


def _where(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


MODELS = Registry("model")
DATASETS = Registry("dataset")
CELLS = Registry("Cell")  # project Cells a keep-list may name, beside mindspore.nn's own (ampzoo/amp/names.py)
