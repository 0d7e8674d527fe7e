"""runtime.cpu_kernels and the cpu_kernels extension's probe: a build whose oneDNN headers do not fit MindSpore's
oneDNN is refused in one line; `on` without the extension is one error line and exit 2; `auto` warns once and
trains on MindSpore's kernels; `off` builds MindSpore's layers wherever the extension is. These run whether or not
the extension is built here (tests/test_cpu_conv.py tests the kernels themselves)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import mindspore.nn as nn
import pytest

import cpu_kernels
from cpu_kernels import LIBRARY, RECORD, check, mismatch, runtime_version, sources_digest, version_text
from ampzoo.engine import network
from ampzoo.models import create_model, layers
from tests.conftest import ROOT, built_with
from ampzoo.errors import ConfigError


def fake_build(directory: Path, headers: str) -> Path:
    """A build record as make install writes it, for headers of version `headers` (the library file is not
    read before the record is)."""
    (directory / LIBRARY).write_bytes(b"\x7fELF")
    (directory / RECORD).write_text(json.dumps({"onednn_headers": headers, "sources": sources_digest()}))
    return directory / LIBRARY


def test_headers_newer_than_mindspores_onednn_are_refused_in_one_line(tmp_path):
    runtime, _ = runtime_version()
    assert runtime[0] == 3  # MindSpore 2.10 bundles oneDNN 3.10
    newer = version_text((runtime[0], runtime[1] + 3, 2))
    path, reason = check(fake_build(tmp_path, newer).parent)
    assert path is None and "\n" not in reason
    assert f"built against oneDNN {newer} headers, but MindSpore's oneDNN is {version_text(runtime)}" in reason
    older = version_text((runtime[0], max(runtime[1] - 1, 0), 1))  # what requirements-data.txt installs
    assert check(fake_build(tmp_path, older).parent) == (tmp_path / LIBRARY, "")
    assert mismatch((2, 9, 0), runtime) and mismatch(runtime, runtime, cpu_runtime=0x1)  # another major; OpenMP
    assert mismatch(runtime, runtime) is None


def test_a_stale_or_missing_build_is_named(tmp_path):
    assert "not built" in check(tmp_path)[1] and "make install" in check(tmp_path)[1]
    fake_build(tmp_path, "3.9.1")
    record = json.loads((tmp_path / RECORD).read_text())
    (tmp_path / RECORD).write_text(json.dumps({**record, "sources": "0" * 16}))
    assert check(tmp_path) == (None, f"the CPU kernels in {tmp_path} were built from other sources; make install "
                                     f"rebuilds them")


def test_on_refuses_and_auto_warns_once_where_the_extension_is_off(tmp_path, monkeypatch, caplog):
    fake_build(tmp_path, "3.99.0")
    monkeypatch.setattr(cpu_kernels, "_installed", lambda: check(tmp_path))
    network._warn_fallback.cache_clear()
    with pytest.raises(ConfigError, match=r"^runtime.cpu_kernels=on, but the CPU kernels are off: built against "
                                          r"oneDNN 3.99.0 headers") as error:
        built_with("on", lambda: create_model("resnet18", num_classes=10, width=8))
    assert "\n" not in str(error.value)
    caplog.set_level("WARNING", logger="amp_zoo")
    nets = [built_with("auto", lambda n=name: create_model(n, num_classes=10)) for name in ("resnet18", "lenet5")]
    assert not any(type(c).__name__.startswith("Cpu") for net in nets for _, c in net.cells_and_names())
    warnings = [r.getMessage() for r in caplog.records if "runtime.cpu_kernels=auto" in r.getMessage()]
    assert len(warnings) == 1 and "3.99.0" in warnings[0]
    network._warn_fallback.cache_clear()


def test_off_builds_mindspores_layers():
    net = built_with("off", lambda: create_model("resnet18", num_classes=10, width=8))
    assert {type(c) for _, c in net.cells_and_names() if isinstance(c, (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d))} \
        == {nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d}
    assert type(built_with("off", lambda: create_model("lenet5", num_classes=10)).pool) is layers.MaxPool2x2


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A Python with this one's packages but nothing built by make install: a venv (the extension is built into
    the environment, cpu_kernels.build_dir) whose site-packages lead to ours."""
    root = tmp_path_factory.mktemp("bare-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    Path(purelib, "amp-zoo-test.pth").write_text("\n".join(ours) + "\n")
    return python


def train(python, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([str(python), "train.py", "recipe=lenet_o0", "trainer.epochs=1", "trainer.max_steps=4",
                           "logger.progress_bar=false", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_on_without_the_extension_is_one_line_and_exit_2(bare_python, tmp_path):
    out = train(bare_python, "runtime.cpu_kernels=on", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: runtime.cpu_kernels=on, but the CPU kernels are not built (no {cpu_kernels_dir(bare_python)}"
        f"/{LIBRARY}); make install builds them (needs g++); or set runtime.cpu_kernels=auto or off"]


def cpu_kernels_dir(python) -> Path:
    return Path(python).parent.parent / "lib" / "amp-zoo-cpu-kernels"


def test_auto_without_the_extension_warns_once_and_trains(bare_python, tmp_path):
    out = train(bare_python, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-2000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("runtime.cpu_kernels=auto: MindSpore's own CPU kernels are used") == 1, log[-2000:]
    assert (tmp_path / "run" / "metrics.json").is_file()


POOL_THREADS = ("import os, sys; {pre}; import cpu_kernels; cpu_kernels.configure({threads}); "
                "print(cpu_kernels.pool_threads())")


@pytest.mark.parametrize("pre,env,threads,want", [
    ("pass", {}, "", "all"),
    ("os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})", {}, "", 1),  # taskset -c 0, or msrun's binding
    ("pass", {"MS_WORKER_NUM": "2", "MS_ROLE": "MS_WORKER"}, "", "half"),  # two msrun workers share the cores
    ("pass", {}, "threads=3", 3),  # runtime.cpu_threads=3
    ("import cpu_kernels; cpu_kernels.pool_threads()", {}, "threads=1", 1),  # a pool already made is made again
])
def test_the_kernels_pool_is_sized_to_the_cores_the_process_may_use(pre, env, threads, want):
    """The pool took every core of the machine whatever the process was allowed (issue 78, item 5): it takes the
    affinity mask's cores, shared among msrun's workers, unless runtime.cpu_threads says otherwise (configure)."""
    if not cpu_kernels.has_ops():
        pytest.skip(cpu_kernels.why_not())
    cores = len(os.sched_getaffinity(0))
    clean = {k: v for k, v in os.environ.items() if k not in ("MS_WORKER_NUM", "MS_ROLE")}
    out = subprocess.run([sys.executable, "-c", POOL_THREADS.format(pre=pre, threads=threads)],
                         env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = {"all": cores, "half": max(1, cores // 2)}.get(want, want)
    assert int(out.stdout.split()[-1]) == expected, (out.stdout, cores)


BUSY_POOL = r"""
import ctypes, subprocess, sys, time
import numpy as np
import cpu_kernels
cpu_kernels.configure(threads=2)
relu = cpu_kernels.loaded().ReluFwd  # an element-wise export, on the pool's threads at this size
x = np.random.RandomState(0).randn(1 << 20).astype(np.float32)
y = np.empty_like(x)
shape = ctypes.cast((ctypes.c_int64 * 1)(x.size), ctypes.POINTER(ctypes.c_int64))
args = (2, (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data), (ctypes.c_int * 2)(1, 1),
        (ctypes.POINTER(ctypes.c_int64) * 2)(shape, shape), (ctypes.c_char_p * 2)(b"float32", b"float32"), None, None)
helper = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # another process, busy on these cores
try:
    end = time.monotonic() + 5
    while time.monotonic() < end and cpu_kernels.pool_busy() == 0:
        assert relu(*args) == 0
finally:
    helper.kill()
print(cpu_kernels.pool_busy(), bool((y == np.maximum(x, 0)).all()))
"""


def test_the_pool_finds_another_busy_process_and_keeps_its_numbers():
    """Beside another busy process the pool's threads would fight it for the cores (issue 78, item 5): the pool
    measures what other processes take of its cores and works on the cores left; a run's BusyMachine line reads
    pool_busy. The regions' pieces are the same, so are the numbers."""
    if not cpu_kernels.has_ops():
        pytest.skip(cpu_kernels.why_not())
    out = subprocess.run([sys.executable, "-c", BUSY_POOL], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found, same = out.stdout.split()
    assert int(found) >= 1 and same == "True", out.stdout


def test_the_environment_holds_one_copy_of_the_openmp_onednn():
    """onednn-cpu-gomp's wheel installs its 54 MB library three times (a wheel holds no links); the build leaves
    one file and two links to it (issue 78), and the kernels load that release only (omp_weights.cc: 3.2)."""
    import importlib.metadata

    from cpu_kernels.build import omp_onednn
    try:
        dist = importlib.metadata.distribution("onednn-cpu-gomp")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("onednn-cpu-gomp is not installed (x86-64 only: make install)")
    omp_onednn()
    copies = [Path(dist.locate_file(f)) for f in dist.files or [] if f.name.startswith("libdnnl.so")]
    assert len(copies) == 3 and len({p.resolve() for p in copies}) == 1, copies
    assert sum(not p.is_symlink() for p in copies) == 1
    if cpu_kernels.has_ops():
        status = cpu_kernels.weight_gradients()
        assert status.startswith(("oneDNN 3.2.", "not used: MindSpore's oneDNN runs AMX")), status
