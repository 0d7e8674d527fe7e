"""Model registry: `create_model("lenet5", num_classes=10)` is the only way the driver meets a model.

A new model is one file here with `@register_model` on its constructor, imported below, and one recipe.
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


from models import lenet, resnet  # noqa: E402,F401  (registers their models)
