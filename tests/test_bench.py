"""The bench's bookkeeping: which runs a resumed bench skips, and the report from results alone."""
import json

from bench.report import write_report
from bench.run import ROOT, finished

COMMITTED = ROOT / "bench" / "results" / "cpu-2026-11-21"


def test_a_resumed_bench_skips_finished_runs_whose_files_are_here(tmp_path):
    (tmp_path / "a").mkdir()
    results = {"runs": [{"id": "a", "status": "ok", "run_dir": str(tmp_path / "a")},
                        {"id": "b", "status": "ok", "run_dir": str(tmp_path / "b")},  # clone: no raw files
                        {"id": "c", "status": "failed", "run_dir": str(tmp_path / "a")}]}
    assert finished(results) == {"a"}


def test_report_from_committed_results_without_raw_runs(tmp_path):
    results = json.loads((COMMITTED / "results.json").read_text())
    for name in ("overhead-lenet_o2.json", "pipeline-lenet_o2.json", "underflow-lenet_o2.json"):
        (tmp_path / name).write_text((COMMITTED / name).read_text())
    for run in results["runs"]:
        run["run_dir"] = str(tmp_path / "raw" / run["id"])  # not there
    write_report(results, tmp_path)
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| lenet_o0 | O0 | none | 3 | 95.37 ± 0.40% |" in md
    assert "| lenet | O2 / fixed | 3 | 95.37 ± 0.40 | 94.77 ± 0.67 | -0.60 | ±1 | yes |" in md
    assert "| resnet34 | O3 / fixed | 2 |" in md and "**no**" in md, "a parity miss is shown, not hidden"
    assert "overhead **+2.6%**" in md and "| lenet_o2 | 77.3 | 72.5 | 101.0% |" in md
    assert (tmp_path / "throughput_vs_o0.png").stat().st_size > 0
