"""make doctor: the self-check a user runs first on a new machine. On this CPU it runs what applies, says what it
skipped, and exits 0; a failing check is one `fails:` line with what to do, and a non-zero exit."""
import os
import re

from cpu_kernels import cpu_compute
from tests.conftest import run_cli

CHECKS = ["device", "overflow", "clean step", "inf forward", "inf backward", "kernels", "cpu kernels", "msrun",
          "sinking", "profiler"]


def test_the_doctor_on_a_cpu_runs_what_applies_and_names_what_it_skipped():
    result = run_cli("doctor.py", timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = result.stdout.strip().splitlines()
    checks = [ln for ln in lines if re.match(r"^[a-z ]{13}(ok|fails|skipped): ", ln)]
    assert [ln[:13].strip() for ln in checks] == CHECKS, lines
    status = {ln[:13].strip(): ln[13:].split(":")[0] for ln in checks}
    assert status == {**dict.fromkeys(CHECKS, "ok"), "device": "skipped", "msrun": "skipped"}, lines
    assert "device       skipped: no device: CPU only (MindSpore 2.10.0" in result.stdout
    assert "inf forward  ok: step skipped, scale 1,024 -> 512" in result.stdout
    assert "inf backward ok: step skipped, scale 16,777,216 -> 8,388,608" in result.stdout
    assert "bf16 absent, as expected on CPU" in result.stdout
    assert re.search(r"cpu kernels  ok: fp16 stored in fp16 between the kernels and computed in fp32 .*; "
                     r"conv\+BatchNorm\+ReLU fp32 [\d.]+ ms, fp16 [\d.]+ ms \([\d.]+x fp32's speed\)"
                     + (r", fp16 with bf16 products [\d.]+ ms" if cpu_compute(asked="bf16") == "bf16" else r"$"),
                     result.stdout, re.M), lines
    assert lines[-2].startswith("skipped: no device: the overflow, kernel, sinking and profiler checks ran on the CPU")
    assert lines[-1] == "doctor: 10 checks, none failed" and result.stderr.strip() == ""


def test_a_failing_check_prints_fails_with_what_to_do_and_exits_non_zero(monkeypatch, capsys):
    """The commonest failure on a new NPU server: the NPUs are there (/dev/davinci*), MindSpore cannot load its
    Ascend plugin (CANN's environment not sourced, or a CPU wheel)."""
    monkeypatch.setattr(os, "environ", os.environ.copy())  # importing doctor prepares the process: keep ours
    import doctor
    monkeypatch.setattr(doctor, "device_hardware", lambda: "Ascend")
    assert doctor.checks() == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("device       fails: this machine has Ascend devices but MindSpore 2.10.0 cannot use "
                               "them (Load dynamic library: libmindspore_ascend.so.2 failed"), lines
    assert "source CANN's set_env.sh" in lines[0]
    assert lines[-1] == "doctor: the device check failed: fix it first, then run make doctor again"
