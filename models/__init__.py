"""Model registry: `create_model("lenet5", num_classes=10)` is the only way the driver meets a model.

A new model is one file here with `@register_model` on its constructor, imported below, and one recipe;
or a module of your own named in AMP_ZOO_PLUGINS (recipes/README.md).
"""
import inspect
from typing import Callable, Dict

MODELS: Dict[str, Callable] = {}


def register_model(fn: Callable) -> Callable:
    MODELS[fn.__name__] = fn
    return fn


def check_model_params(name: str, params: dict) -> None:
    from zoo.config import ConfigError, choices_hint

    accepted = inspect.signature(MODELS[name]).parameters
    if any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        return
    for key in params:
        if key not in accepted or key == "num_classes":
            valid = [k for k in accepted if k != "num_classes"]
            raise ConfigError(f"model.params.{key} is not an argument of model {name!r}; "
                              + choices_hint(key, valid or ["(none)"]))


def create_model(name: str, num_classes: int, **params):
    if name not in MODELS:
        from zoo.config import ConfigError, choices_hint
        raise ConfigError(f"model {name!r} is not registered; " + choices_hint(name, MODELS))
    check_model_params(name, params)
    return MODELS[name](num_classes=num_classes, **params)


from models import lenet, resnet, transformer  # noqa: E402,F401  (registers their models)


def _import_plugins() -> None:
    """Models kept outside the repository: module names in AMP_ZOO_PLUGINS (comma-separated), which register
    themselves with @register_model. Set by the user in the environment, never by a recipe."""
    import importlib
    import os

    for name in filter(None, (n.strip() for n in os.environ.get("AMP_ZOO_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            from zoo.config import ConfigError
            raise ConfigError(f"AMP_ZOO_PLUGINS names {name!r}, which cannot be imported: {e}") from None


_import_plugins()
