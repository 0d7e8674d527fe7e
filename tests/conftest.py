"""Shared fixtures. The suite starts as a command does (ampzoo.entry first: MindSpore's C++ log lines off)."""
import ampzoo.entry  # noqa: F401  (first: a command's start-up, before MindSpore loads)

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mindspore as ms
import pytest

from ampzoo.runtime import cap_onednn_isa

# The suite builds networks in any order, MindSpore's convolutions among them: one fixed AVX2 cap, before the
# first kernel runs, which the commands the tests start inherit as the user's (the auto cap is tested in
# processes of their own, test_cpu_conv.py)
cap_onednn_isa("AVX2", needs_cap=True)
ms.set_device("CPU")  # once, before any kernel runs: MindSpore refuses to set it later

ROOT = Path(__file__).resolve().parent.parent


def run_cli(script: str, *args: str, cwd=ROOT, timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """Run one of the project's commands as a user would, in a fresh process (`env`: added variables)."""
    env = {**{k: v for k, v in os.environ.items() if k != "MS_OM_PATH"}, **(env or {})}  # an in-process
    # train() of an earlier test sets MS_OM_PATH to its run directory: not the place for this command's files
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, *script.split(), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def built_with(cpu_kernels: str, build):
    """build()'s network (plain MindSpore) as runtime.cpu_kernels=`cpu_kernels` has it: the CPU kernels applied where
    that lets them run (ampzoo.engine.network; `on` where they cannot: its error)."""
    from ampzoo.engine.network import accelerate, use_cpu_kernels
    kernels = use_cpu_kernels(cpu_kernels)
    net = build()
    return accelerate(net) if kernels else net


def finished_run_dir(tmp_path_factory, name: str, *args: str) -> Path:
    """A train.py run trained to its end in a directory of its own (for a module-scoped fixture)."""
    run_dir = tmp_path_factory.mktemp(name) / "run"
    result = run_cli("train.py", *args, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def fork(root: Path, module: str, model_src: str, recipe: str, recipe_src: str):
    """A model module and its recipe outside the repository, as a user forks one: returns the environment
    that imports the module and the Hydra override that finds the recipe."""
    (root / f"{module}.py").write_text(textwrap.dedent(model_src))
    (root / "recipes" / "recipe").mkdir(parents=True, exist_ok=True)
    (root / "recipes" / "recipe" / f"{recipe}.yaml").write_text(recipe_src.lstrip())
    env = {"AMP_ZOO_PLUGINS": module, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return env, f"hydra.searchpath=[file://{root / 'recipes'}]"


class _PoolLoss(ms.nn.Cell):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def construct(self, x, g):
        return (self.pool(x) * g).sum()


def pool_grad(pool, x, g):
    """A pooling Cell's input gradient for the output gradient g, in a compiled graph (the max-pool tests)."""
    return ms.jit(ms.grad(_PoolLoss(pool), grad_position=0))(x, g).asnumpy()


@pytest.fixture
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)
    yield


@pytest.fixture
def fp32_products():
    """The CPU kernels at their default settings (fp32 products) for the test, and as they were afterwards."""
    import dataclasses

    import cpu_kernels
    before = cpu_kernels.settings()
    cpu_kernels.configure(**dataclasses.asdict(cpu_kernels.Settings()))
    yield
    cpu_kernels.configure(**dataclasses.asdict(before))


@pytest.fixture
def pynative_mode():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)


# The files whose tests run the commands end to end, in processes of their own (train.py runs, resumes, signals,
# msrun, exit codes): marked `e2e`. `make test-fast` runs the rest, the in-process tests; `make test` runs both.
E2E_FILES = {"test_amp_tools.py", "test_bad_inputs.py", "test_distributed.py", "test_endings.py", "test_fork.py",
             "test_fuse_export.py", "test_lab.py", "test_lenet_e2e.py", "test_resume.py", "test_run_dir.py",
             "test_search.py", "test_transformer.py", "test_weights.py"}
# ...and the few such tests in files that are otherwise in-process
E2E_TESTS = {"test_resnet.py::test_resnet34_o2_smoke_run_from_a_fresh_checkout",
             "test_structure.py::test_only_the_entry_helper_sets_up_mindspore",
             "test_structure.py::test_only_the_five_packages_are_importable",
             "test_cpu_conv.py::test_export_writes_mindspores_own_conv2d",
             "test_cpu_conv.py::test_the_avx2_cap_is_lifted_only_for_a_network_without_mindspores_convolutions",
             "test_cpu_kernels.py::test_on_without_the_extension_is_one_line_and_exit_2",
             "test_cpu_kernels.py::test_auto_without_the_extension_warns_once_and_trains",
             "test_doctor.py::test_the_doctor_on_a_cpu_runs_what_applies_and_names_what_it_skipped",
             "test_device_paths.py::test_msrun_without_distributed_is_refused_on_every_process",
             "test_hydra_flags.py::test_hydra_flags_work_in_any_position",
             "test_hydra_flags.py::test_multirun_flag_in_any_position_checks_every_run",
             "test_process.py::test_a_failed_run_keeps_the_users_own_empty_folders",
             "test_process.py::test_distributed_without_msrun_is_one_line",
             "test_process.py::test_a_sweep_goes_on_past_a_job_that_diverges"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in E2E_FILES or f"{item.path.name}::{item.originalname}" in E2E_TESTS:
            item.add_marker(pytest.mark.e2e)
