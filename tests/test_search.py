"""amp.search: on a model with one Cell that overflows in fp16, the search keeps exactly that Cell in fp32."""
import json
import re

import pytest

from tests.conftest import fork, run_cli

MODEL = '''
import mindspore.nn as nn
from ampzoo.registry import MODELS


class Rescale(nn.Cell):
    """x * 1e5 * 1e-5: the identity in fp32; in fp16, 1e5 is already inf (a scale that overflows)."""
    def __init__(self):
        super().__init__()
        self.gain, self.inv = 1e5, 1e-5

    def construct(self, x):
        return x * self.gain * self.inv


class RescaleNet(nn.Cell):
    def __init__(self, num_classes=10, hidden=64):
        super().__init__()
        self.flatten, self.fc1, self.relu = nn.Flatten(), nn.Dense(32 * 32, hidden), nn.ReLU()
        self.rescale, self.fc2 = Rescale(), nn.Dense(hidden, num_classes)

    def construct(self, x):
        return self.fc2(self.rescale(self.relu(self.fc1(self.flatten(x)))))


@MODELS.register()
def rescalenet(num_classes=10, hidden=64):
    return RescaleNet(num_classes, hidden)
'''

RECIPE = '''
# @package _global_
# RescaleNet on MNIST, O2, dynamic loss scale: its Rescale Cell overflows in fp16.
defaults:
  - override /dataset: mnist
model:
  name: rescalenet
  num_classes: 10
amp:
  level: O2
  loss_scale: {type: dynamic, init_scale: 1024, min_scale: 1}
optimizer:
  lr: 0.05
trainer:
  epochs: 2
target:
  metric: top1
  published: null
  source: none
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    env, search = fork(root, "rescale_models", MODEL, "rescalenet_o2", RECIPE)
    return root, env, [search, "recipe=rescalenet_o2", "search.seeds=[1]", "search.tolerance=2",
                       f"search.out={root / 'out'}"]


def run_search(env, args, *extra):
    return run_cli("-m amp.search", *args, *extra, timeout=900, env=env)


def test_search_keeps_exactly_the_overflowing_cell_and_resumes(plugin):
    root, env, args = plugin
    result = run_search(env, args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = json.loads((root / "out" / "result.json").read_text())
    assert out["ranked"][0] == "rescale"  # the audit saw it overflow
    assert "overflow" in next(u for u in out["units"] if u["path"] == "rescale")["flags"]
    by_k = {c["k"]: c for c in out["candidates"]}
    assert by_k[0]["verdict"] == "diverged"  # all fp16: the rescale overflows every step
    winner = by_k[out["winner"]]
    assert winner["kept"] == ["rescale"] and winner["keep_fp32"] == ["rescale"] and winner["verdict"] == "within"
    assert 0.9 < winner["low_flops"] < 1.0  # fc1 and fc2 in fp16 hold nearly all the FLOPs
    assert "Winner: amp.level=O3 amp.keep_fp32=[rescale]" in result.stdout
    assert (root / "out" / "search.png").stat().st_size > 0
    recipe = (root / "out" / "rescalenet_o2_searched.yaml").read_text()
    assert "- rescalenet_o2" in recipe and "keep_fp32: [rescale]" in recipe
    assert "# Copy this file beside rescalenet_o2.yaml and run" in recipe  # a fork's recipes/recipe/, not recipes/
    # the winning policy as a user runs it: only the rescale computes in fp32
    (root / "recipes" / "recipe" / "rescalenet_o2_searched.yaml").write_text(recipe)
    report = run_cli("-m amp.report", args[0], "recipe=rescalenet_o2_searched", env=env)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "| rescale | Rescale | float32 |" in report.stdout
    assert re.search(r"\| fc1 \| (Cpu)?Dense \| float16 \|", report.stdout), report.stdout  # CpuDense: the kernels

    again = run_search(env, args)  # a resumed search trains nothing it has already judged
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this call trained 0 of them" in again.stdout
    assert json.loads((root / "out" / "result.json").read_text())["winner"] == out["winner"]


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_pinned_cells_are_respected(plugin):
    root, env, args = plugin
    pinned = run_search(env, args, "search.pin_fp32=[fc2]")
    assert pinned.returncode == 0, pinned.stderr[-3000:]
    out = json.loads((root / "out" / "result.json").read_text())
    assert "fc2" not in out["ranked"] and all("fc2" in c["kept"] for c in out["candidates"])
    assert sorted(next(c for c in out["candidates"] if c["k"] == out["winner"])["kept"]) == ["fc2", "rescale"]

    never = run_search(env, args, "search.pin_low=[rescale]")  # the one Cell that must be fp32 may not be: no winner
    assert never.returncode == 1, never.stderr[-3000:]
    out = json.loads((root / "out" / "result.json").read_text())
    assert out["winner"] is None and all("rescale" not in c["kept"] for c in out["candidates"])
    assert "No candidate is within 2 of O0" in never.stdout


@pytest.mark.parametrize("extra, message", [
    (["search.tolerance=-1"], "search.tolerance=-1"),
    (["search.metric=bleu"], "search.metric='bleu' is not a metric of this classification recipe"),
    (["search.seeds=[]"], "search.seeds=[] must be one or more distinct seeds"),
    (["amp.level=O2"], "amp.level is set by amp.search for every run; give search.pin_fp32 / search.pin_low"),
    (["trainer.epochs=3"], "trainer.epochs is set by amp.search for every run; give search.budget_epochs"),
    (["search.pin_fp32=[LayerNorm]"], "search.pin_fp32: LayerNorm matches no compute unit of LeNet5"),
    (["search.pin_fp32=[nosuch]"], "search.pin_fp32: 'nosuch' is neither a Cell class nor a sub-module of LeNet5"),
    (["search.pin_fp32=[Dense]", "search.pin_low=[fc1]"], "fc1 is pinned both fp32"),
])
def test_bad_search_settings_are_one_line(tmp_path, extra, message):
    result = run_cli("-m amp.search", "recipe=lenet_o2", f"search.out={tmp_path / 'out'}", *extra)
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_search_directory_with_other_settings_is_refused(tmp_path):
    (tmp_path / "settings.json").write_text(json.dumps({"recipe": "lenet_o2", "train_overrides": ["x=1"]}))
    result = run_cli("-m amp.search", "recipe=lenet_o2", f"search.out={tmp_path}")
    assert result.returncode == 2 and "holds a search with other training settings (x=1)" in result.stderr


def test_bisection_and_keep_list_compression():
    from ampzoo.amp.ranking import Unit, bisect, keep_list, rank
    from ampzoo.models import create_model

    calls = []

    def passes(k):
        calls.append(k)
        return k >= 5
    assert bisect(12, passes) == 5 and len(calls) <= 2 + 4
    assert bisect(3, lambda k: False) is None and bisect(3, lambda k: True) == 0

    net = create_model("lenet5", num_classes=10)
    units = [Unit(p, type(c).__name__, 0, 1, [], 0.0) for p, c in net.cells_and_names() if p]
    assert keep_list(["fc1", "fc2", "fc3"], units, net) == ["Dense"]
    assert keep_list(["conv1", "fc3"], units, net) == ["conv1", "fc3"]
    import mindspore.nn as nn
    resnet = create_model("resnet18", num_classes=10, stem="cifar", in_channels=1, width=8)
    convs = [Unit(p, type(c).__name__, 0, 1, [], 0.0) for p, c in resnet.cells_and_names()
             if isinstance(c, nn.Conv2d)]
    # on the CPU they are CpuConv2d; the written list must hold on Ascend too
    assert keep_list([u.path for u in convs], convs, resnet) == ["Conv2d"]
    # max-pooling only selects values, whichever kernel runs it (CpuMaxPool2x2 on the CPU): never a candidate
    assert "pool" in [u.path for u in units] and "pool" not in [u.path for u in rank(units)]


@pytest.mark.parametrize("warmup,noted", [(2, True), (0.25, False)])
def test_a_budget_inside_the_warm_up_is_noted(capsys, warmup, noted):
    """A budget that ends inside the recipe's warm-up judges every run at its peak learning rate (on
    resnet18_fashion_o2 at 1 epoch, O0 landed at 85.11 and 74.06 over two seeds): the search says so, and what
    schedule.warmup_epochs compresses the recipe's schedule into the budget."""
    from amp.search.command import check_settings
    from ampzoo.engine.load import load_config
    argv = ["recipe=lenet_o2", f"schedule.warmup_epochs={warmup}", "search.budget_epochs=1"]
    cfg, _ = load_config(argv)
    assert "trainer.epochs=1" in check_settings(cfg, argv)
    err = capsys.readouterr().err
    assert ("ends inside the recipe's warm-up" in err) is noted
    if noted:
        assert f"schedule.warmup_epochs={warmup / cfg.trainer.epochs:g}" in err


def test_a_winner_is_named_only_when_the_budget_can_tell_candidates_apart():
    """O0's seeds that differ by more than the tolerance, or one seed whose noise is unmeasured, leave the
    candidates undecided (and say what budget would decide); rivals that diverged decide even with one seed."""
    from omegaconf import OmegaConf

    from ampzoo.amp.ranking import Candidate
    from amp.search.command import inconclusive
    s = OmegaConf.create({"tolerance": 0.5, "budget_steps": 40, "budget_epochs": 0})
    cfg = OmegaConf.create({"trainer": {"epochs": 10}})
    within = Candidate(0, [], [], 1.0, 1.0, verdict="within", delta=0.2)
    outside = Candidate(3, ["fc"], ["fc"], 0.9, 0.9, verdict="outside", delta=-0.9)
    diverged = Candidate(0, [], [], 1.0, 1.0, verdict="diverged")
    noisy = {1: {"metric": 0.463}, 2: {"metric": 0.335}}
    quiet = {1: {"metric": 0.940}, 2: {"metric": 0.942}}
    said = inconclusive({0: within}, 0, noisy, 100.0, s, cfg)
    assert "O0's own seeds differ by std 9.05" in said and "search.budget_steps=80" in said
    assert inconclusive({0: within, 3: outside}, 0, quiet, 100.0, s, cfg) is None
    one_seed = inconclusive({3: within, 0: outside}, 3, {1: {"metric": 0.94}}, 100.0, s, cfg)
    assert "one seed cannot measure" in one_seed and "search.seeds=[1,2]" in one_seed
    assert inconclusive({1: within, 0: diverged}, 1, {1: {"metric": 0.94}}, 100.0, s, cfg) is None


def test_a_shipped_weight_is_searched_under_its_own_recipe(tmp_path):
    """amp.search weights=NAME searched the default recipe (LeNet-5 on MNIST) fine-tuned from the weight: it takes
    the weight's recipe and overrides, as eval.py does, and every training run starts from the weight (the
    settings every run gets, written before the first; here a bad pin stops it right after)."""
    from pathlib import Path

    from ampzoo.engine.weights import read_manifest
    if not Path("/usr/share/datasets/fashion-mnist").is_dir():
        pytest.skip("needs Fashion-MNIST: apt-get install dataset-fashion-mnist")
    entry = read_manifest()["lenet_fashion_o2"]
    result = run_cli("-m amp.search", "weights=lenet_fashion_o2", f"search.out={tmp_path}", "search.pin_fp32=[nosuch]")
    assert result.returncode == 2 and "weights lenet_fashion_o2: sha256 verified" in result.stderr, result.stderr
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings == {"recipe": entry["recipe"], "train_overrides": [f"recipe={entry['recipe']}", *entry["overrides"],
                                                                       "weights=lenet_fashion_o2",
                                                                       "trainer.eval_every=0"]}
