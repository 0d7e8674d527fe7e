"""Forking a recipe: a new model in a module outside the repo and its recipe on Hydra's search path."""
import json

from tests.conftest import fork, run_cli

MODEL = '''
import mindspore.nn as nn
from zoo.registry import MODELS


class TinyNet(nn.Cell):
    def __init__(self, num_classes=10, hidden=32):
        super().__init__()
        self.flatten, self.fc1, self.relu = nn.Flatten(), nn.Dense(32 * 32, hidden), nn.ReLU()
        self.fc2 = nn.Dense(hidden, num_classes)

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(self.flatten(x))))


@MODELS.register()
def tinynet(num_classes=10, hidden=32):
    return TinyNet(num_classes, hidden)
'''

RECIPE = '''
# @package _global_
# TinyNet on MNIST, O2, dynamic loss scale.
defaults:
  - override /dataset: mnist
model:
  name: tinynet
  num_classes: 10
  params: {hidden: 64}
amp:
  level: O2
  loss_scale: {type: dynamic}
trainer:
  epochs: 2
target:
  metric: top1
  published: null
  source: none
'''


def test_forked_recipe_trains_without_touching_the_repo(tmp_path):
    env, search = fork(tmp_path, "my_models", MODEL, "tinynet_o2", RECIPE)
    run = tmp_path / "run"
    result = run_cli("train.py", search, "recipe=tinynet_o2", "logger.progress_bar=false", f"hydra.run.dir={run}",
                     env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["model"] == "tinynet" and metrics["amp_level"] == "O2" and metrics["steps"] == 250
    assert metrics["final"]["top1"] > 0.8
    report = run_cli("-m amp.report", search, "recipe=tinynet_o2", env=env)
    assert report.returncode == 0 and "| fc1 | Dense | float16 |" in report.stdout


def test_a_forked_model_that_does_not_compile_is_one_line(tmp_path):
    broken = MODEL.replace("return self.fc2(self.relu(self.fc1(self.flatten(x))))",
                           "return self.fc2(self.flatten(x))  # shape bug: fc2 takes `hidden` features")
    env, search = fork(tmp_path, "my_models", broken, "tinynet_o2", RECIPE)
    run = tmp_path / "run"
    result = run_cli("train.py", search, "recipe=tinynet_o2", "logger.progress_bar=false", f"hydra.run.dir={run}",
                     env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "model 'tinynet' (recipe tinynet_o2) does not compile" in errors[0]
    assert "MatMul" in errors[0] or "Dense" in errors[0], errors[0]
    assert "Traceback" in (run / "train.log").read_text(), "the full trace is kept in train.log"
