"""Every recipe composes against the schema and passes validation; its card states its target."""
from pathlib import Path

import pytest

from ampzoo.compose import compose
from ampzoo.engine.load import validate
from ampzoo.errors import ConfigError

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


# The schedules behind the ResNet-34 cards' numbers, as their sources set them (each card cites its source):
# torchvision's reference recipe, mindcv's configs/resnet/resnet_34_ascend.yaml, the MindSpore model zoo's
# official/cv/ResNet/config/resnet34_imagenet2012_config.yaml.
PUBLISHED_SCHEDULES = {
    "resnet34_o0": {"trainer.epochs": 90, "schedule.name": "step", "schedule.milestones": [30, 60],
                    "schedule.gamma": 0.1, "schedule.warmup_epochs": 0, "trainer.label_smoothing": 0,
                    "optimizer.decay_norm_and_bias": True, "dataset.batch_size": 32, "optimizer.lr": 0.1},
    "resnet34_o2": {"trainer.epochs": 120, "schedule.name": "cosine", "schedule.warmup_epochs": 0,
                    "schedule.min_lr": 0, "trainer.label_smoothing": 0.1, "optimizer.decay_norm_and_bias": False,
                    "dataset.batch_size": 32, "optimizer.lr": 0.1},
    "resnet34_o3": {"trainer.epochs": 90, "schedule.name": "linear", "schedule.warmup_epochs": 2,
                    "schedule.min_lr": 0, "trainer.label_smoothing": 0.1, "optimizer.decay_norm_and_bias": True,
                    "dataset.batch_size": 256, "optimizer.lr": 0.1, "optimizer.reference_batch_size": 256},
}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED_SCHEDULES))
def test_each_resnet34_card_says_how_to_train_its_numbers_schedule(recipe):
    """The three ResNet-34 cards share one schedule (they differ in precision alone), which is none of their
    cited numbers' own: each card says what differs, and its published-schedule line trains that number's."""
    from omegaconf import OmegaConf

    card = (Path(__file__).resolve().parent.parent / "recipes" / f"{recipe}.yaml").read_text()
    assert "It is none of the cited numbers' own." in card and "What differs from the schedule" in card
    [line] = [ln for ln in card.splitlines() if ln.startswith("# published-schedule: ")]
    shared = compose([f"recipe={recipe}"])
    assert (shared.trainer.epochs, shared.schedule.name, shared.schedule.warmup_epochs) == (90, "cosine", 5)
    cfg = compose([f"recipe={recipe}", *line.removeprefix("# published-schedule: ").split()])
    validate(cfg, needs_data=False)
    got = {key: OmegaConf.select(cfg, key) for key in PUBLISHED_SCHEDULES[recipe]}
    got = {k: (list(v) if OmegaConf.is_list(v) else str(v) if k == "schedule.name" else v) for k, v in got.items()}
    assert got == PUBLISHED_SCHEDULES[recipe]


def test_the_linear_schedule_warms_up_then_decays_to_min_lr():
    """schedule.name=linear (the MindSpore model zoo's ResNet decay): linear warm-up, then a straight line from the
    peak to min_lr at the last step."""
    import numpy as np
    from omegaconf import OmegaConf

    from ampzoo.engine.optim import lr_schedule
    lr = lr_schedule(OmegaConf.create({"name": "linear", "warmup_epochs": 2, "warmup_steps": 0, "min_lr": 0.0}),
                     0.8, 10, 10)
    np.testing.assert_allclose(lr[:20], 0.8 * np.arange(1, 21) / 20, rtol=1e-6)
    np.testing.assert_allclose(lr[20:], 0.8 - 0.8 * np.arange(80) / 80, rtol=1e-5, atol=1e-7)
