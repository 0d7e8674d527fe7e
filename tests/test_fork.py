"""Forking a recipe: a new model in a module outside the repo and its recipe on Hydra's search path."""
import json
import re

import pytest

from tests.conftest import ROOT, fork, run_cli

MODEL = '''
import mindspore.nn as nn
from ampzoo.registry import MODELS


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
    assert report.returncode == 0, report.stderr[-3000:]
    assert re.search(r"\| fc1 \| (Cpu)?Dense \| float16 \|", report.stdout), report.stdout  # CpuDense: on the kernels


def test_a_forked_model_that_does_not_compile_is_one_line(tmp_path):
    broken = MODEL.replace("return self.fc2(self.relu(self.fc1(self.flatten(x))))",
                           "return self.fc2(self.flatten(x))  # shape bug: fc2 takes `hidden` features")
    env, search = fork(tmp_path, "my_models", broken, "tinynet_o2", RECIPE)
    run = tmp_path / "run"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_cli(str(ROOT / "train.py"), search, "recipe=tinynet_o2", "logger.progress_bar=false",
                     f"hydra.run.dir={run}", env=env, cwd=cwd)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "model 'tinynet' (recipe tinynet_o2) does not compile" in errors[0]
    assert "MatMul" in errors[0] or "Dense" in errors[0], errors[0]
    assert "Traceback" in (run / "train.log").read_text(), "the full trace is kept in train.log"
    assert f"MindSpore's account of the graph: {run / 'rank_0/om/analyze_fail.ir'}" in errors[0]
    assert not any(cwd.iterdir()), "nothing of MindSpore's in the user's folder"


def test_each_job_of_a_multirun_gets_its_own_account_of_the_graph(tmp_path):
    """`train.py -m` runs its jobs in one process: the job that does not compile has MindSpore's analyze_fail.ir
    in its own run directory, and its error line names that file, not one in the first job's directory."""
    broken = MODEL.replace("return self.fc2(self.relu(self.fc1(self.flatten(x))))",
                           "return self.fc2(self.flatten(x))  # compiles only with hidden=1024 (32 x 32 inputs)")
    env, search = fork(tmp_path, "my_models", broken, "tinynet_o2", RECIPE)
    sweep = tmp_path / "sweep"
    result = run_cli("train.py", "-m", search, "recipe=tinynet_o2", "model.params.hidden=1024,64",
                     "trainer.max_steps=2", "logger.progress_bar=false", f"hydra.sweep.dir={sweep}", env=env)
    assert result.returncode == 2 and (sweep / "0-tinynet_o2" / "metrics.json").is_file(), result.stderr[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    graph = sweep / "1-tinynet_o2" / "rank_0/om/analyze_fail.ir"
    assert len(errors) == 1 and f"MindSpore's account of the graph: {graph}" in errors[0], errors
    assert not (sweep / "0-tinynet_o2" / "rank_0").exists()


def test_a_graph_account_an_earlier_process_left_is_not_named(tmp_path, monkeypatch):
    """A run directory kept after a model that did not compile, started again: when this process fails in its
    first step without a new analyze_fail.ir, the line does not offer the earlier process's as this failure's."""
    import os
    import types

    from ampzoo.engine.process import failures
    left = tmp_path / "rank_0" / "om" / "analyze_fail.ir"
    left.parent.mkdir(parents=True)
    left.write_text("the earlier graph")
    os.utime(left, (failures.STARTED - 60, failures.STARTED - 60))
    monkeypatch.setenv("MS_OM_PATH", str(tmp_path))
    run = types.SimpleNamespace(rank=0, run_dir=tmp_path, is_main=True,
                                cfg=types.SimpleNamespace(model=types.SimpleNamespace(name="tinynet"),
                                                          recipe_name="tinynet_o2"))
    assert "account of the graph" not in failures.compile_error(run, RuntimeError("For 'MatMul' ..."))
    left.touch()  # written by this process
    assert f"account of the graph: {left}" in failures.compile_error(run, RuntimeError("For 'MatMul' ..."))


def one_error(result) -> str:
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return errors[0]


def test_the_fork_works_from_the_users_own_folder(tmp_path):
    """`python /path/to/train.py` from the folder holding my_models.py, with no PYTHONPATH of the user's: the
    plugin is found there (here the run stops at a bad epoch count, after the model was found)."""
    _, search = fork(tmp_path, "my_models", MODEL, "tinynet_o2", RECIPE)
    result = run_cli(f"{ROOT / 'train.py'}", search, "recipe=tinynet_o2", "trainer.epochs=0", cwd=tmp_path,
                     env={"AMP_ZOO_PLUGINS": "my_models"})
    assert "trainer.epochs" in one_error(result)


OLD_API = '''
import mindspore.nn as nn
from models import register_model


@register_model
def tinynet(num_classes=10, hidden=32):
    return nn.SequentialCell([nn.Flatten(), nn.Dense(32 * 32, num_classes)])
'''


@pytest.mark.parametrize("module, source, plugins, message", [
    ("my_models", "x = 1 / 0\n", "my_models",
     "plugin 'my_models' (AMP_ZOO_PLUGINS) failed while importing: ZeroDivisionError: division by zero"),
    ("my_models", "from ampzoo.models import no_such_api\n", "my_models", "from ampzoo.registry import MODELS"),
    ("my_models", MODEL, "my_modles", "AMP_ZOO_PLUGINS names 'my_modles', which cannot be imported"),
    ("my_models", MODEL, "", "AMP_ZOO_PLUGINS, which is not set"),
    # python -m from a folder with a cpu_kernels.py: the zoo imported it instead of its own package (a traceback)
    ("cpu_kernels", MODEL, "my_models", "cpu_kernels.py has the name of one of amp-zoo's own modules, and this "
                                        "folder comes first on the path (python -m): rename it (e.g. "
                                        "my_cpu_kernels.py"),
])
def test_a_plugin_that_does_not_load_is_one_line(tmp_path, module, source, plugins, message):
    _, search = fork(tmp_path, module, source, "tinynet_o2", RECIPE)
    result = run_cli("-m amp.report", search, "recipe=tinynet_o2", cwd=tmp_path, env={"AMP_ZOO_PLUGINS": plugins})
    assert message in one_error(result)


def test_a_plugin_written_for_the_old_api_says_what_replaced_it(tmp_path):
    """`from models import register_model` (deprecated since the registry came) cannot import now that the models
    live in ampzoo.models: one line says what to write instead."""
    _, search = fork(tmp_path, "my_models", OLD_API, "tinynet_o2", RECIPE)
    line = one_error(run_cli("-m amp.report", search, "recipe=tinynet_o2", cwd=tmp_path,
                             env={"AMP_ZOO_PLUGINS": "my_models"}))
    assert ("plugin 'my_models' (AMP_ZOO_PLUGINS) uses the old API (`from models import register_model`): register "
            "models with `from ampzoo.registry import MODELS` and `@MODELS.register()`") in line, line


def test_a_recipe_not_found_names_the_folders_searched(tmp_path):
    _, search = fork(tmp_path, "my_models", MODEL, "tinynet_o2", RECIPE)
    line = one_error(run_cli("train.py", search, "recipe=tinynet_o3"))
    assert f"looked in {ROOT / 'recipes'}, {tmp_path / 'recipes' / 'recipe'}" in line and "tinynet_o2" in line


SHADOWING = '''
from ampzoo.registry import MODELS
from ampzoo.models.lenet import LeNet5


@MODELS.register({args})
def my_lenet5(num_classes=10, in_channels=1):
    return LeNet5(num_classes, in_channels)
'''


def test_a_fork_recipe_named_like_a_shipped_one_is_one_line(tmp_path):
    """recipes/recipe/lenet_o2.yaml of your own: Hydra read the shipped lenet_o2 instead, silently."""
    _, search = fork(tmp_path, "my_models", MODEL, "lenet_o2", RECIPE)
    line = one_error(run_cli("train.py", search, "recipe=lenet_o2", f"hydra.run.dir={tmp_path / 'run'}"))
    assert (f"recipe=lenet_o2: {tmp_path / 'recipes' / 'recipe' / 'lenet_o2.yaml'} has the name of a shipped recipe "
            f"(recipes/lenet_o2.yaml), which Hydra reads instead of yours; rename yours") in line, line
    assert not (tmp_path / "run").exists()


def test_a_plugin_registering_a_shipped_models_name_is_refused_or_named(tmp_path):
    """A plugin's `lenet5` replaced the shipped LeNet-5 in every recipe, silently: now one line, unless it says
    override=True, and then the run's description (its log's first lines, config.yaml) names whose model runs."""
    env, search = fork(tmp_path, "my_models", SHADOWING.format(args='"lenet5"'), "tinynet_o2", RECIPE)
    line = one_error(run_cli("train.py", "recipe=lenet_o2", f"hydra.run.dir={tmp_path / 'run'}", env=env))
    assert ("plugin 'my_models' (AMP_ZOO_PLUGINS): my_models.my_lenet5 registers the model name 'lenet5', which "
            "ampzoo.models.lenet.lenet5 has") in line and "override=True" in line, line
    env, _ = fork(tmp_path, "my_models", SHADOWING.format(args='"lenet5", override=True'), "tinynet_o2", RECIPE)
    run = tmp_path / "run"
    result = run_cli("train.py", "recipe=lenet_o2", "trainer.max_steps=1", "logger.progress_bar=false",
                     f"hydra.run.dir={run}", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    named = "[model 'lenet5' is my_models.my_lenet5, registered with override=True over the shipped one]"
    from omegaconf import OmegaConf
    assert named in (run / "train.log").read_text() and named in OmegaConf.load(run / "config.yaml").description


@pytest.mark.parametrize("module, message", [
    ("bench", "AMP_ZOO_PLUGINS names 'bench', a module of amp-zoo itself"),
    ("code", "plugin 'code' (AMP_ZOO_PLUGINS) registered no model, dataset or Cell: the module imported is /"),
])
def test_a_plugin_that_another_module_shadows_is_one_line(tmp_path, module, message):
    """A plugin file named like a module that comes first on the path (the zoo's own bench, the standard
    library's code) was never imported, silently: the model it registers was then "not registered"."""
    _, search = fork(tmp_path, module, MODEL, "tinynet_o2", RECIPE)
    result = run_cli(f"{ROOT / 'train.py'}", search, "recipe=tinynet_o2", cwd=tmp_path,
                     env={"AMP_ZOO_PLUGINS": module})
    assert message in one_error(result)
