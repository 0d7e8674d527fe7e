"""Every recipe composes against the schema and passes validation; its card states its target."""
from pathlib import Path

import pytest

from zoo.compose import compose
from zoo.errors import ConfigError
from engine.load import validate

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_recipes_exist():
    assert {"lenet_o0", "lenet_o2", "lenet_o3", "resnet34_o0", "resnet34_o2", "resnet34_o3", "resnet34_cifar10_o2",
            "transformer_base_o0", "transformer_base_o2", "transformer_tiny_multi30k_o0",
            "transformer_tiny_multi30k_o2", "lenet_fashion_o0", "lenet_fashion_o2", "lenet_fashion_o3"} <= set(RECIPES)


@pytest.mark.parametrize("level", ["o0", "o2", "o3"])
def test_fashion_recipes_share_the_mnist_amp_blocks(level):
    fashion, mnist = compose([f"recipe=lenet_fashion_{level}"]), compose([f"recipe=lenet_{level}"])
    assert fashion.amp == mnist.amp
    assert fashion.dataset.path == "/usr/share/datasets/fashion-mnist" and len(fashion.dataset.params.classes) == 10
    assert fashion.target.published == 91.6 and "zalandoresearch/fashion-mnist" in fashion.target.source


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe):
    cfg = compose([f"recipe={recipe}"])
    if cfg.dataset.path and not Path(cfg.dataset.path).exists():  # a system data package that is not installed
        with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
            validate(cfg)
        cfg = compose([f"recipe={recipe}", "dataset.path=null"])
    validate(cfg)
    assert cfg.recipe_name == recipe
    assert cfg.amp.level.value == recipe.rsplit("_", 1)[-1].upper()
    assert cfg.target.source, "a recipe states the number it targets and its source (or that there is none)"
    assert cfg.target.published is not None or cfg.target.source == "none"


def test_overrides_reach_any_key():
    cfg = compose(["recipe=lenet_o2", "trainer.epochs=2", "amp.loss_scale.type=dynamic"])
    assert cfg.trainer.epochs == 2 and cfg.amp.loss_scale.type.value == "dynamic"
    assert cfg.amp.level.value == "O2"
