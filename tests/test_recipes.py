"""Every recipe composes against the schema and passes validation; its card states its target."""
from pathlib import Path

import pytest

from zoo.config import compose, validate

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_recipes_exist():
    assert {"lenet_o0", "lenet_o2", "lenet_o3", "resnet34_o0", "resnet34_o2", "resnet34_o3", "resnet34_cifar10_o2",
            "transformer_base_o0", "transformer_base_o2"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe):
    cfg = compose([f"recipe={recipe}"])
    validate(cfg)
    assert cfg.recipe_name == recipe
    assert cfg.amp.level.value == recipe.rsplit("_", 1)[-1].upper()
    assert cfg.target.source, "a recipe states the number it targets and its source (or that there is none)"
    assert cfg.target.published is not None or cfg.target.source == "none"


def test_overrides_reach_any_key():
    cfg = compose(["recipe=lenet_o2", "trainer.epochs=2", "amp.loss_scale.type=dynamic"])
    assert cfg.trainer.epochs == 2 and cfg.amp.loss_scale.type.value == "dynamic"
    assert cfg.amp.level.value == "O2"
