"""python -m amp.report and python -m amp.audit: every recipe, level diffs, and what the audit flags."""
import re
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

import mindspore as ms
import mindspore.nn as nn

from tests.conftest import run_cli
from amp.audit.command import audit
from amp.report.command import build_report
from ampzoo.registry import CELLS

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_report_for_every_recipe(recipe):
    report = build_report([f"recipe={recipe}"])
    level = report["level"]
    dtypes = {r["compute_dtype"] for r in report["cells"]}
    assert dtypes == ({"float32"} if level == "O0" else {"float16"} if level == "O3" else dtypes)
    assert report["parameters"] > 0 and report["summary"].startswith(level)


def test_report_and_diff_cli():
    out = run_cli("-m amp.report", "recipe=lenet_o2")
    assert out.returncode == 0, out.stderr
    # Conv2d is the CPU kernels' CpuConv2d (an nn.Conv2d) where they are built
    assert re.search(r"\| conv1 \| (Cpu)?Conv2d \| float16 \| Float32 \|", out.stdout), out.stdout
    out = run_cli("-m amp.report", "recipe=lenet_o0", "--diff", "O1", "O3")
    assert out.returncode == 0, out.stderr
    # ReLU is the CPU kernels' CpuReLU (an nn.ReLU) where they are built
    assert re.search(r"\| relu \| (Cpu)?ReLU \| float32 \| float16 \| O3 default \|", out.stdout), out.stdout
    assert "4 of 9 Cells change compute dtype." in out.stdout
    bad = run_cli("-m amp.report", "recipe=lenet_o0", "--diff", "O1", "O7")
    assert bad.returncode == 2 and "--diff takes two levels" in bad.stderr


def test_audit_cli_on_a_recipe():
    out = run_cli("-m amp.audit", "recipe=lenet_o2")
    assert out.returncode == 0, out.stderr
    assert re.search(r"\| conv1 \| (Cpu)?Conv2d \| float16 \|", out.stdout), out.stdout
    assert "suggested: amp.keep_fp32=[" in out.stdout
    # it says which arithmetic it measured: the products O2 trains with on this CPU (issue 80, item 7)
    assert re.search(r"^measured with (fp32|bf16) products, as training computes them here", out.stdout, re.M)


@CELLS.register()
class Amplify(nn.Cell):
    """Multiplies by 1e5: fine in fp32, overflows fp16 for activations above 0.65."""

    def construct(self, x):
        return x * 1e5


class Risky(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(8, 8)
        self.amp = Amplify()
        self.ln = nn.LayerNorm((8,), epsilon=1e-8)
        self.head = nn.Dense(8, 2)

    def construct(self, x):
        return self.head(self.ln(self.amp(self.fc(x))))


def test_audit_flags_overflow_and_vanishing_constants():
    ms.set_seed(0)
    batch = (ms.Tensor(np.random.RandomState(0).randn(4, 8).astype(np.float32) * 3),)
    cfg = OmegaConf.create({"level": "O3", "dtype": "float16", "keep_fp32": None, "force_fp16": []})
    result = audit(Risky, cfg, batch)
    rows = {r["path"]: r for r in result["cells"]}
    assert "overflow" in rows["amp"]["flags"] and rows["amp"]["max_abs_fp32"] > 65504
    assert rows["ln"]["constants"] == ["epsilon=1e-08 is 0 in float16"]
    assert "constant" in rows["ln"]["flags"]
    assert not rows["fc"]["flags"], rows["fc"]
    assert result["suggested_keep_fp32"] == ["Amplify", "LayerNorm"]


def test_audit_runs_a_recipe_on_its_smoke_data():
    """`python -m amp.audit recipe=resnet34_o2` without dataset.path: the smoke block, like train.py."""
    result = run_cli("-m amp.audit", "recipe=resnet34_o2", "+model.params.width=8", "dataset.batch_size=8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SMOKE RUN" in result.stderr and "your dataset.batch_size kept" in result.stderr
    assert "suggested: amp.keep_fp32=[" in result.stdout


def test_audit_without_a_recipes_own_data_measures_the_embedded_digits(monkeypatch):
    """A Fashion-MNIST recipe on a machine without the package: the audit stands the embedded MNIST digits in
    (same format) and says so; a dataset.path the user gives must exist."""
    import amp.audit.command as tool
    from ampzoo.engine.load import load_config
    from ampzoo.errors import ConfigError

    absent = "/no/fashion-mnist"
    real = load_config
    monkeypatch.setattr(tool, "load_config", lambda argv, **kw: real([*argv, f"dataset.path={absent}"], **kw))
    cfg, note = tool.audit_config(["recipe=resnet18_fashion_o2"])  # as if the recipe's own path were absent
    assert cfg.dataset.path is None and note.startswith(f"note: {absent} is not on this machine (Debian's package")
    assert "embedded MNIST digits" in note
    batch = next(tool.create_dataset(cfg.dataset, "train").create_tuple_iterator())
    assert tuple(batch[0].shape) == (128, 1, 28, 28)
    with pytest.raises(ConfigError, match="does not exist: install Debian's package"):
        tool.audit_config(["recipe=resnet18_fashion_o2", f"dataset.path={absent}"])


def test_the_tools_set_up_mindspore_only_as_entry_points():
    """Importing the tools caps no oneDNN ISA; run as a command it follows the recipe's
    runtime.onednn_isa (the Transformer recipes set none) and answers --help."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    env["PYTHONPATH"] = str(ROOT)
    probe = subprocess.run([sys.executable, "-c", "import os, amp.report.command, amp.audit.command, "
                            "amp.search.command; print(os.environ.get('ONEDNN_MAX_CPU_ISA'))"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == "None", probe.stderr[-1000:]
    for tool in ("amp.report", "amp.audit"):
        out = run_cli(f"-m {tool}", "--help")
        assert out.returncode == 0 and f"python -m {tool} recipe=" in out.stdout, out.stderr[-1000:]


def test_audit_leaves_value_selecting_cells_out_and_marks_a_repeated_keep_list():
    """At a tolerance no fp16 Cell meets, the Cells that compute are flagged; ReLU, max-pooling and Flatten,
    which only select or move values, are not; the suggestion says when it only repeats the recipe."""
    from amp.audit.command import to_markdown
    from ampzoo.data import create_dataset
    from ampzoo.engine.load import load_config
    from ampzoo.engine.network import build_model

    cfg, _ = load_config(["recipe=lenet_o2"])
    batch = next(create_dataset(cfg.dataset, "train").create_tuple_iterator())
    strict = audit(lambda: build_model(cfg), cfg.amp, batch[:-1], tolerance=1e-9)
    rows = {r["class"]: r for r in strict["cells"]}
    assert "error" in rows["Conv2d" if "Conv2d" in rows else "CpuConv2d"]["flags"]
    assert "error" in rows["CpuDense" if "CpuDense" in rows else "Dense"]["flags"]
    for cls in ("CpuReLU" if "CpuReLU" in rows else "ReLU", "Flatten"):
        assert rows[cls]["flags"] == [] and rows[cls]["selects_values"]
    assert strict["flagged_classes"] == ["Conv2d", "Dense"] and strict["suggestion_adds"] == ["Conv2d", "Dense"]
    loose = audit(lambda: build_model(cfg), cfg.amp, batch[:-1])
    assert loose["suggestion_adds"] == []
    assert "(the recipe's own keep-list: the audit adds nothing)" in to_markdown(loose)


def test_audit_and_report_look_at_the_weights_they_are_given():
    """weights=NAME: the shipped file (sha256 checked) in its own recipe, named in the output; no weights: the
    output says the network is freshly initialised."""
    report = run_cli("-m amp.report", "weights=lenet_fashion_o3")
    assert report.returncode == 0, report.stderr[-2000:]
    assert report.stdout.startswith("weights: shipped weights lenet_fashion_o3 (")
    assert "sha256 verified" in report.stdout
    assert "# Precision report: O3" in report.stdout
    audited = run_cli("-m amp.audit", "weights=lenet_fashion_o2")
    assert audited.returncode == 0, audited.stderr[-2000:]
    assert "weights: shipped weights lenet_fashion_o2 (" in audited.stdout
    fresh = run_cli("-m amp.audit", "recipe=lenet_o2")
    assert "weights: freshly initialised (seed 1)" in fresh.stdout
    # trained weights hold larger activations than the initial ones: the audit sees the network it is given
    def top(out):
        return max(float(ln.split("|")[4]) for ln in out.splitlines() if ln.startswith("| fc"))
    assert top(audited.stdout) > 5 * top(fresh.stdout)
    wrong = run_cli("-m amp.audit", "weights=lenet_fashion_o2", "recipe=resnet34_o2")
    assert wrong.returncode == 2 and "drop recipe=" in wrong.stderr


def test_a_runs_checkpoint_is_looked_at_in_its_runs_network(tmp_path_factory):
    """checkpoint= of a train.py run: the network its run trained (its config.yaml: here 3 input channels), not the
    recipe as written (1), or the weights would not load."""
    from tests.conftest import finished_run_dir
    run = finished_run_dir(tmp_path_factory, "three_channels", "recipe=lenet_o2", "dataset.channels=3",
                           "+model.params.in_channels=3", "trainer.max_steps=2", "logger.progress_bar=false")
    [ckpt] = (run / "checkpoints").glob("*.ckpt")
    report = run_cli("-m amp.report", f"checkpoint={ckpt}")
    assert report.returncode == 0, report.stderr[-2000:]
    assert re.search(r"\| fc3 \| (Cpu)?Dense \| float16 \|", report.stdout) and f"checkpoint {ckpt}" in report.stdout
    audited = run_cli("-m amp.audit", f"checkpoint={ckpt}")
    assert audited.returncode == 0, audited.stderr[-2000:]
    assert f"weights: checkpoint {ckpt}" in audited.stdout
