"""The lab's experiments still run: the Transformer report's bookkeeping, a decode override checked before any
checkpoint is read, and the fp16 op timings on a small tensor."""
import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.lab  # the lab is not the product: make test-lab (or make test-all) runs these, make test not


def test_transformer_report_lines_runs_up_at_equal_updates(tmp_path):
    """Two batches an update (update_freq 2): its epoch 2 is the same number of updates as epoch 1 of a run
    with one batch an update, and that is where the report compares them."""
    from bench.lab.transformer_report import runs_compared

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


def test_transformer_report_names_each_multi30k_run(tmp_path):
    from bench.lab.transformer_report import multi30k_tables
    run_dir, out = tmp_path / "tiny_o0", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    (run_dir / "multi30k_curve.json").write_text(json.dumps({"1": {"bleu_lowercase": 30.0, "bleu": 29.0, "beam": 1}}))
    lines = []
    multi30k_tables(lines, [run_dir], out)
    assert lines[0] == "### Multi30k run `tiny_o0`: val BLEU per epoch"


def test_transformer_report_compares_a_kept_curve_by_its_update_freq(tmp_path):
    """A run directory lost with its machine leaves its curve in bench/results (NAME_curve.json): the report
    still lines it up at equal updates, by the update_freq its records carry."""
    from bench.lab.transformer_report import runs_compared

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
    from bench.lab.transformer_report import runs_compared

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
    """bench.lab.decode takes key=value over the run's config (amp.level=O0 for an O2 run); a key that is not in the
    schema is one error line and exit 2, before any checkpoint is read."""
    from omegaconf import OmegaConf

    from ampzoo.compose import compose
    from bench.lab.decode import main

    OmegaConf.save(compose(["recipe=transformer_tiny_multi30k_o2"]), tmp_path / "config.yaml")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "amp.levell=O0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: overrides ['amp.levell=O0']") and "levell" in err and "\n" not in err


def test_fp16_ops_times_each_op_in_both_precisions(tmp_path):
    """bench.lab.fp16_ops, the evidence behind 'fp16 costs time on a CPU': every op in fp32 and fp16, with the cores
    it keeps busy, on a small tensor here."""
    out = tmp_path / "fp16_ops.json"
    result = run_cli("-m bench.lab.fp16_ops", "--shape", "2,4,8,8", "--repeats", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-1000:]
    assert "relu: fp16 takes" in result.stdout and "add: fp16 takes" in result.stdout
    record = json.loads(out.read_text())
    assert record["shape"] == [2, 4, 8, 8] and set(record["ops"]) == {
        "cast fp32->fp16", "cast fp16->fp32", "relu fp32", "relu fp16", "add fp32", "add fp16"}
    assert all(op["ms"] > 0 and op["cores_busy"] > 0 for op in record["ops"].values())
    bad = run_cli("-m bench.lab.fp16_ops", "--shape", "2,x")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --shape '2,x': give positive sizes separated by commas, e.g. 128,64,28,28"]


def test_the_transformer_experiments_compose_the_setting_their_records_were_taken_at():
    """bench.lab.transformer_parts, transformer_speed and torch_multi30k recorded their figures at the old Multi30k
    setting (cased text, 8,000-piece sentencepiece, one 4,096-token batch an update). The recipes now default
    to the published one (10,000 BPE pieces, two batches an update), so each experiment pins setting=cased_4k."""
    from bench.common import bench_config
    from bench.lab import torch_multi30k, transformer_parts, transformer_speed

    default = bench_config(["recipe=transformer_tiny_multi30k_o0"], smoke=False)
    assert (default.model.num_classes, default.trainer.update_freq) == (10000, 2)  # what the pin guards against
    composed = [transformer_parts.config(), torch_multi30k.config(["runtime.seed=2"]),
                *(transformer_speed.our_config(recipe, extra) for _, recipe, extra in transformer_speed.SETTINGS)]
    for cfg in composed:
        assert (cfg.model.num_classes, cfg.trainer.update_freq, cfg.trainer.max_steps) == (8000, 1, 8000)
        assert not cfg.dataset.params.get("lowercase") and cfg.dataset.params.get("spm_type", "unigram") == "unigram"
    assert composed[1].runtime.seed == 2  # the command line's overrides still apply
    with pytest.raises(SystemExit):  # its loop has no gradient accumulation
        torch_multi30k.config(["trainer.update_freq=2"])
