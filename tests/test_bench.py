"""The bench's bookkeeping: which runs a resumed bench skips, and the report from results alone."""
import json

import pytest

from bench.report import write_report
from bench.run import ROOT, finished, train
from tests.conftest import run_cli

COMMITTED = ROOT / "bench" / "results" / "cpu-2026-11-21"


def test_a_resumed_bench_skips_finished_runs_whose_files_are_here(tmp_path):
    (tmp_path / "a").mkdir()
    results = {"runs": [{"id": "a", "status": "ok", "run_dir": str(tmp_path / "a")},
                        {"id": "b", "status": "ok", "run_dir": str(tmp_path / "b")},  # clone: no raw files
                        {"id": "c", "status": "failed", "run_dir": str(tmp_path / "a")}]}
    assert finished(results) == {"a"}


def test_report_from_committed_results_without_raw_runs(tmp_path):
    results = json.loads((COMMITTED / "results.json").read_text())
    for run in results["runs"]:
        run["run_dir"] = str(tmp_path / "raw" / run["id"])  # not there
    write_report(results, tmp_path)
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| lenet_o0 | O0 | none | 3 | 95.37 ± 0.40% |" in md
    assert "| lenet | O2 / fixed | 3 | 95.37 ± 0.40 | 94.77 ± 0.67 | -0.60 | ±1 | yes |" in md
    assert "| resnet34 | O3 / fixed | 2 |" in md and "**no**" in md, "a parity miss is shown, not hidden"
    assert "bench/lab/underflow.py" in md, "the report points to the experiments' answers, not to files it lacks"
    assert (tmp_path / "throughput_vs_o0.png").stat().st_size > 0


def test_a_speed_ratio_carries_the_interval_its_rounds_allow():
    from bench.common import ratio, ratio_ci
    peer = [100.0, 100.0, 100.0, 100.0, 100.0, 100.0]
    steady = [90.0, 91.0, 89.0, 90.0, 90.5, 89.5]   # every round ~1.11x: the interval stays above 1.0
    noisy = [80.0, 125.0, 95.0, 110.0, 85.0, 105.0]  # rounds on both sides of 1.0
    lo, hi = ratio_ci(peer, steady)
    assert 1.0 < lo <= ratio(peer, steady) <= hi <= max(p / s for p, s in zip(peer, steady))
    lo, hi = ratio_ci(peer, noisy)
    assert lo < 1.0 < hi
    assert ratio_ci(peer, peer) == [1.0, 1.0]


def test_a_timed_result_says_when_the_machine_was_not_quiet(tmp_path, capsys):
    """A benchmark taken beside a training run halves its numbers: the result records how many cores other
    processes kept busy, and says on stderr that its times are not quiet."""
    import subprocess
    import sys

    from bench.common import save_result
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 30\nwhile time.time() < t: pass"])
    try:
        out = save_result("x", {"rows": {}}, tmp_path / "x.json")
    finally:
        spinner.kill()
        spinner.wait()
    assert json.loads(out.read_text())["busy_elsewhere_cores"] >= 0.5
    assert "times are not quiet" in capsys.readouterr().err
    untimed = save_result("y", {"rows": {}}, tmp_path / "y.json", timed=False)
    assert "busy_elsewhere_cores" not in json.loads(untimed.read_text())


def test_the_bench_deletes_no_directory_it_did_not_make(tmp_path, capsys):
    """A run's directory under --out that bench.run did not make (no marker) is the user's: one error line and
    exit 2, its files kept; nothing is started."""
    run_dir = tmp_path / "raw" / "lenet_o2-O2-dynamic-s1"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as stop:
        train(run_dir, ["recipe=lenet_o2"])
    assert stop.value.code == 2 and (run_dir / "notes.txt").read_text() == "mine"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run_dir) in err[0] and "--out" in err[0]


def test_the_pytorch_peer_of_the_cifar10_card_says_what_it_needs(tmp_path):
    """bench.torch_cifar10 is bench-only: without PyTorch it is one line naming the install, exit 2; its network
    is torchvision's ResNet-34 with the zoo's CIFAR stem (the same parameter count as ours) where PyTorch is."""
    import importlib.util
    out = run_cli("-m bench.torch_cifar10", str(tmp_path / "peer"), f"dataset.path={tmp_path}")
    if importlib.util.find_spec("torch") is None:
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            "error: PyTorch is not installed: pip install torch torchvision (bench-only, not in the zoo's install)"]
        return
    from bench.torch_cifar10 import peer_network
    from ampzoo.models import create_model
    ours = sum(p.size for p in create_model("resnet34", num_classes=10, stem="cifar").trainable_params())
    assert sum(p.numel() for p in peer_network(10).parameters()) == ours
