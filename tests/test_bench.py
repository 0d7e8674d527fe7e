"""The bench's bookkeeping: which runs a resumed bench skips, and the report from results alone."""
import json

import pytest

from bench.report import write_report
from bench.run import ROOT, finished
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


def test_transformer_report_lines_runs_up_at_equal_updates(tmp_path):
    """Two batches an update (update_freq 2): its epoch 2 is the same number of updates as epoch 1 of a run
    with one batch an update, and that is where the report compares them."""
    from bench.transformer_report import runs_compared

    def run(name, freq, bleu):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(f"trainer:\n  update_freq: {freq}\n")
        (d / "multi30k_curve.json").write_text(json.dumps(
            {str(e): {"step": 140 * e, "bleu_lowercase": b, "bleu": b - 1} for e, b in enumerate(bleu, 1)}))
        return d
    lines = []
    runs_compared(lines, [run("o0", 1, [10.0, 20.0]), run("k2", 2, [4.0, 12.5, 16.0, 21.0])], tmp_path)
    md = "\n".join(lines)
    assert "| 140 | 10.00 | 12.50 |" in md and "| 280 | 20.00 | 21.00 |" in md
    assert "| 70 |" not in md, "updates only one run was scored at are left out"
    assert "mean +1.75 BLEU, largest +2.50" in md
    assert (tmp_path / "runs_compared.png").stat().st_size > 0


def test_transformer_report_compares_a_kept_curve_by_its_update_freq(tmp_path):
    """A run directory lost with its machine leaves its curve in bench/results (NAME_curve.json): the report
    still lines it up at equal updates, by the update_freq its records carry."""
    from bench.transformer_report import runs_compared

    run = tmp_path / "o2"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  update_freq: 1\n")
    (run / "multi30k_curve.json").write_text(json.dumps({"1": {"step": 140, "bleu_lowercase": 9.0, "bleu": 8.0}}))
    kept = tmp_path / "k2_curve.json"
    kept.write_text(json.dumps({str(e): {"step": 140 * e, "update_freq": 2, "bleu_lowercase": b, "bleu": b}
                                for e, b in ((1, 4.0), (2, 12.5))}))
    lines = []
    runs_compared(lines, [run, kept], tmp_path)
    md = "\n".join(lines)
    assert "| 140 | 9.00 | 12.50 |" in md and "`k2`" in md


def test_transformer_report_reads_a_run_with_other_epochs_between_its_scores(tmp_path):
    """Another vocabulary makes epochs of another length (the published BPE: 129 batches, ours: 140): the runs
    are compared at the first run's updates, the other read between its two neighbouring scores and marked."""
    from bench.transformer_report import runs_compared

    def kept(name, per, bleu):
        path = tmp_path / f"{name}_curve.json"
        path.write_text(json.dumps({str(e): {"step": per * e, "bleu_lowercase": b, "bleu": b}
                                    for e, b in enumerate(bleu, 1)}))
        return path
    lines = []
    runs_compared(lines, [kept("bpe", 100, [9.0, 21.0]), kept("spm", 70, [7.0, 14.0, 21.0])], tmp_path)
    md = "\n".join(lines)
    assert "| 100 | 9.00 | ~10.00 |" in md and "| 200 | 21.00 | ~20.00 |" in md
    assert "mean +0.00 BLEU, largest +1.00" in md


def test_decode_bench_names_a_bad_override_in_one_line(tmp_path, capsys):
    """bench.decode takes key=value over the run's config (amp.level=O0 for an O2 run); a key that is not in the
    schema is one error line and exit 2, before any checkpoint is read."""
    from omegaconf import OmegaConf

    from bench.decode import main
    from zoo.compose import compose

    OmegaConf.save(compose(["recipe=transformer_tiny_multi30k_o2"]), tmp_path / "config.yaml")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "amp.levell=O0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: overrides ['amp.levell=O0']") and "levell" in err and "\n" not in err


def test_fp16_ops_times_each_op_in_both_precisions(tmp_path):
    """bench.fp16_ops, the evidence behind 'fp16 costs time on a CPU': every op in fp32 and fp16, with the cores
    it keeps busy, on a small tensor here."""
    out = tmp_path / "fp16_ops.json"
    result = run_cli("-m bench.fp16_ops", "--shape", "2,4,8,8", "--repeats", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-1000:]
    assert "relu: fp16 takes" in result.stdout and "add: fp16 takes" in result.stdout
    record = json.loads(out.read_text())
    assert record["shape"] == [2, 4, 8, 8] and set(record["ops"]) == {
        "cast fp32->fp16", "cast fp16->fp32", "relu fp32", "relu fp16", "add fp32", "add fp16"}
    assert all(op["ms"] > 0 and op["cores_busy"] > 0 for op in record["ops"].values())
    bad = run_cli("-m bench.fp16_ops", "--shape", "2,x")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --shape '2,x': give positive sizes separated by commas, e.g. 128,64,28,28"]


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
