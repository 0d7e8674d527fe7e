"""bench.reproduce bookkeeping on fake runs: which data is found, resume, the rows for absent data."""
import json
import os
import re
import shutil
from datetime import datetime

import pytest

from bench import reproduce as rp


@pytest.fixture
def fake_runner():
    calls = []

    def run(cmd, log):
        args = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        run_dir = rp.Path(args["hydra.run.dir"])
        calls.append(cmd)
        if "stop" in run_dir.name and "resume=auto" not in cmd:  # killed mid-run: a checkpoint, no metrics
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoints" / "lenet5-e0001-s00000937.ckpt").write_bytes(b"")
            return -15
        seed = int(args["runtime.seed"])
        (run_dir / "train.log").write_text(
            "[2026-11-22 07:00:00,000][amp_zoo][INFO] - recipe x: y\n"
            "[2026-11-22 07:01:40,000][amp_zoo][INFO] - final\n")
        metrics = {"steps": 18740, "device": "CPU", "wall_time_s": 1.0, "samples_per_s": 1000.0 * seed,
                   "throughput_unit": "samples", "final": {"top1": 0.90 + seed / 1000},
                   "amp": {"setting": "O0 with no loss scaling", "overflow_steps": 0, "skipped_steps": 0}}
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        (run_dir / "eval_history.jsonl").write_text("".join(
            json.dumps({"epoch": e, "step": 937 * e, "top1": 0.8 + e / 100 + seed / 1000}) + "\n" for e in (1, 2)))
        return 0
    run.calls = calls
    return run


def seeds(monkeypatch, **per_recipe):
    """The recipes' seeds (bench.reproduce.PLANS), as a test wants them (the plans say 1-3)."""
    def card(name, real=rp.recipe_card):
        c = real(name)
        c["target"]["seeds"] = per_recipe.get(name, c["target"]["seeds"])
        return c
    monkeypatch.setattr(rp, "recipe_card", card)


def test_runs_each_seed_once_and_names_absent_data(tmp_path, fake_runner, monkeypatch):
    data = tmp_path / "fashion"
    data.mkdir()
    seeds(monkeypatch, lenet_fashion_o0=[1, 2])
    args = dict(recipes=["lenet_fashion_o0", "lenet_o2"], given={"fashion_mnist": str(data)},
                runs=tmp_path / "runs", out=tmp_path / "out", runner=fake_runner, readme=None)
    table = rp.reproduce(**args)["table"]
    assert len(fake_runner.calls) == 2
    assert f"dataset.path={data}" in fake_runner.calls[0] and "runtime.seed=2" in fake_runner.calls[1]
    row = next(line for line in table.splitlines() if "`lenet_fashion_o0`" in line)
    assert "**90.15** ± 0.07 (90.10, 90.20)" in row and "| 2 |" in row and "2 min a run, 1,500 samples/s" in row
    absent = next(line for line in table.splitlines() if "`lenet_o2`" in line)
    assert "not found (mnist)" in absent and "`python -m bench.reproduce --data mnist=PATH`" in absent
    cited = re.search(r"\| 98.42 top1 \[(\d)\] \|", absent).group(1)  # the published setting, cited by number
    assert re.search(rf"^{cited}\. 98.42 top1: full MNIST, 10 epochs.*; MindSpore model zoo", table, re.M)
    assert rp.reproduce(**args)["table"] == table and len(fake_runner.calls) == 2, "finished runs are not run again"
    records = json.loads((tmp_path / "out" / "reproduce.json").read_text())["runs"]
    assert sorted(records) == ["lenet_fashion_o0-s1", "lenet_fashion_o0-s2"]
    assert records["lenet_fashion_o0-s2"]["curve"] == [[937, 81.2], [1874, 82.2]], "test top-1 per eval, in %"
    assert (tmp_path / "out" / "curves_lenet_fashion.png").stat().st_size > 10_000
    assert "![curves_lenet_fashion](curves_lenet_fashion.png)" in (tmp_path / "out" / "REPRODUCE.md").read_text()


def test_a_killed_run_continues_with_resume_auto(tmp_path, fake_runner, monkeypatch):
    data = tmp_path / "fashion"
    data.mkdir()
    args = dict(recipes=["lenet_fashion_o0"], given={"fashion_mnist": str(data)}, runs=tmp_path / "runs",
                out=tmp_path / "out", runner=fake_runner, readme=None)
    seeds(monkeypatch, lenet_fashion_o0=[1])
    stopped = tmp_path / "runs" / "lenet_fashion_o0-s1"
    monkeypatch.setattr(rp, "train_command", lambda r, d, s, run_dir, f=rp.train_command: f(
        r, d, s, run_dir.with_name(run_dir.name + "-stop")))
    assert "not finished yet" in rp.reproduce(**args)["table"]
    assert "resume=auto" not in fake_runner.calls[0]
    rp.reproduce(**args)
    assert "resume=auto" in fake_runner.calls[1]
    assert (stopped.with_name(stopped.name + "-stop") / "metrics.json").is_file()


def test_the_readme_is_written_once_with_the_table_it_ends_with(tmp_path, fake_runner, monkeypatch):
    """With --write, README.md's table is the one reproduce ends with, written once: not rewritten after every
    run (OUT/REPRODUCE.md is the table as it stands)."""
    data = tmp_path / "fashion"
    data.mkdir()
    seeds(monkeypatch, lenet_fashion_o0=[1, 2])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{rp.README_BEGIN}\nold table\n{rp.README_END}\n")
    written = []
    monkeypatch.setattr(rp, "write_readme", lambda table, path, real=rp.write_readme: written.append(table) or
                        real(table, path))
    table = rp.reproduce(recipes=["lenet_fashion_o0"], given={"fashion_mnist": str(data)}, runs=tmp_path / "runs",
                         out=tmp_path / "out", runner=fake_runner, readme=readme)["table"]
    assert len(fake_runner.calls) == 2 and written == [table] and table in readme.read_text()


def test_no_function_of_reproduce_is_over_60_lines():
    import ast
    tree = ast.parse(rp.Path(rp.__file__).read_text())
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "reproduce" in lengths and max(lengths.values()) <= 60, {k: n for k, n in lengths.items() if n > 60}


def test_the_readme_table_is_replaced_between_its_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{rp.README_BEGIN}\nold table\n{rp.README_END}\nafter\n")
    assert rp.write_readme("| new |\n", readme)
    assert readme.read_text() == f"intro\n{rp.README_BEGIN}\n| new |\n{rp.README_END}\nafter\n"


def test_training_time_sums_the_sessions_of_a_resumed_run(tmp_path):
    (tmp_path / "train.log").write_text("[2026-11-22 07:00:00,000][amp_zoo][INFO] - recipe a: b\n"
                                        "[2026-11-22 07:10:00,500][amp_zoo][WARNING] - SIGTERM: stopped\n"
                                        "[2026-11-22 09:00:00,000][amp_zoo][INFO] - recipe a: b\n"
                                        "[2026-11-22 09:05:00,000][amp_zoo][INFO] - final\n")
    assert rp.training_wall_time(tmp_path) == 900.5


def test_a_session_killed_outright_ends_at_its_last_checkpoint(tmp_path):
    """SIGKILL (a machine going away) leaves no log line at the end: the checkpoints it wrote say how far it got."""
    (tmp_path / "train.log").write_text("[2026-11-22 07:00:00,000][amp_zoo][INFO] - recipe a: b\n"
                                        "[2026-11-22 07:01:00,000][amp_zoo][INFO] - epoch 1/9: step 10\n"
                                        "[2026-11-22 09:00:00,000][amp_zoo][INFO] - recipe a: b\n"
                                        "[2026-11-22 09:05:00,000][amp_zoo][INFO] - final\n")
    def at(hms):
        return datetime.strptime(f"2026-11-22 {hms}", "%Y-%m-%d %H:%M:%S").timestamp()
    (tmp_path / "checkpoints").mkdir()
    for name, hms in [("e0001-s00000010", "07:01:00"), ("e0003-s00000030", "07:20:00"),
                      ("e0004-s00000040", "09:03:00")]:
        ckpt = tmp_path / "checkpoints" / f"lenet5-{name}.ckpt"
        ckpt.write_bytes(b"")
        os.utime(ckpt, (at(hms), at(hms)))
    assert rp.training_wall_time(tmp_path) == 20 * 60 + 5 * 60


@pytest.mark.parametrize("argv, message", [
    (["--data", "fashion"], "give GROUP=PATH"),
    (["--data", "fashon_mnist=/x"], "did you mean fashion_mnist"),
    (["--data", "fashion_mnist=/no/such/folder"], "--data fashion_mnist=/no/such/folder: no such folder"),
    (["--only", "lenet_o9"], "is not a recipe"),
    (["--seeds", "0"], "a whole number >= 1"),
    (["--bogus"], "unknown argument '--bogus'"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        rp.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_the_readme_table_is_written_only_from_the_repositorys_own_results(tmp_path):
    """--out elsewhere (a scratch reproduction in a worktree) must not rewrite README.md: a modified checkout
    would mark every run trained from it as modified."""
    assert rp.parse(["--write"])[-2] == rp.ROOT / "README.md"
    assert rp.parse(["--out", str(rp.DEFAULT_OUT), "--write"])[-2] == rp.ROOT / "README.md"
    assert rp.parse(["--out", str(tmp_path / "out"), "--write"])[-2] is None
    assert rp.parse([])[-2:] == (None, True), "a reproduction records its runs; README.md only with --write"
    assert rp.parse(["--plan"])[-1] is False and rp.parse(["--table"])[-1] is False
    assert rp.parse(["--table", "--write"])[-1] is True


def test_plan_prints_hours_first_and_plan_and_table_write_nothing(tmp_path, fake_runner, monkeypatch, capsys):
    """--plan and --table write nothing (not the tracked results, not README.md); the plan gives each run's hours
    (recorded runs at the recipe's own setting, else its plan's hours) and the total, before any run."""
    data = tmp_path / "fashion"
    data.mkdir()
    seeds(monkeypatch, lenet_fashion_o0=[1, 2], lenet_fashion_o2=[1])
    out = tmp_path / "out"
    out.mkdir()
    (out / "reproduce.json").write_text(json.dumps({"runs": {
        "lenet_fashion_o0-s9": {"wall_time_s": 5400.0, "data": "/elsewhere"},
        "lenet_fashion_o2-s9": {"wall_time_s": 99999.0, "overrides": ["x=1"], "data": "/elsewhere"}}}))
    before = (out / "reproduce.json").read_text()
    args = dict(recipes=["lenet_fashion_o0", "lenet_fashion_o2"], given={"fashion_mnist": str(data)},
                runs=tmp_path / "runs", out=out, runner=fake_runner)
    rp.reproduce(**args, plan_only=True)
    printed = capsys.readouterr().out
    assert "plan: lenet_fashion_o0 seed 1: about 1.5 h" in printed
    assert "plan: lenet_fashion_o0 seed 2: about 1.5 h" in printed
    assert "plan: lenet_fashion_o2 seed 1: time unknown" in printed  # its one record trained at another setting
    assert "plan: 3 runs to train, about 3 hours" in printed and printed.index("plan:") < printed.index("would run:")
    assert not fake_runner.calls and sorted(p.name for p in out.iterdir()) == ["reproduce.json"]
    rp.reproduce(**args, only=[], write=False)  # --table
    assert (out / "reproduce.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["reproduce.json"]
    assert rp.hours("transformer_tiny_multi30k_o2", rp.recipe_card("transformer_tiny_multi30k_o2")["target"], {}) > 1


def test_only_runs_the_named_recipes_and_shows_where_others_stand(tmp_path, fake_runner, monkeypatch):
    data = tmp_path / "fashion"
    data.mkdir()
    seeds(monkeypatch, lenet_fashion_o0=[1])
    seeds(monkeypatch, lenet_fashion_o2=[1])
    half = tmp_path / "runs" / "lenet_fashion_o2-s1" / "checkpoints"
    half.mkdir(parents=True)
    (half / "lenet5-e0003-s00002811.ckpt").write_bytes(b"")
    table = rp.reproduce(["lenet_fashion_o0", "lenet_fashion_o2"], {"fashion_mnist": str(data)}, tmp_path / "runs",
                         tmp_path / "out", runner=fake_runner, readme=None, only=["lenet_fashion_o0"])["table"]
    assert len(fake_runner.calls) == 1 and "recipe=lenet_fashion_o0" in fake_runner.calls[0]
    row = next(line for line in table.splitlines() if "`lenet_fashion_o2`" in line)
    assert "unfinished: seed 1: epoch 3, step 2,811 (`make reproduce` continues it)" in row


def test_seeds_runs_only_the_first_seeds_and_keeps_every_recorded_run(tmp_path, fake_runner, monkeypatch):
    data = tmp_path / "fashion"
    data.mkdir()
    seeds(monkeypatch, lenet_fashion_o0=[1, 2, 3])
    args = dict(recipes=["lenet_fashion_o0"], given={"fashion_mnist": str(data)}, runs=tmp_path / "runs",
                out=tmp_path / "out", runner=fake_runner, readme=None)
    rp.reproduce(**args, max_seeds=1)
    assert [c for c in fake_runner.calls if "runtime.seed=1" in c] == fake_runner.calls and len(fake_runner.calls) == 1
    table = rp.reproduce(**args)["table"]  # all three seeds now
    assert len(fake_runner.calls) == 3 and "| 3 |" in table
    assert rp.reproduce(**args, max_seeds=1)["table"] == table, "the table keeps the runs past the first seeds"


def test_a_machine_kind_names_its_vector_isa():
    """Two CPUs of one model name, one without AVX-512, ran a ResNet step at different speeds: a run's machine
    names the vector ISA, and the two do not compare."""
    from ampzoo.machine import machine, machine_kind, vector_isa
    assert vector_isa("fpu sse2 avx avx2 fma".split()) == "AVX2"
    assert vector_isa("avx avx2 avx512f avx512bw".split()) == "AVX-512"
    assert vector_isa("avx2 avx512f amx_tile amx_bf16".split()) == "AVX-512, AMX"
    assert vector_isa(["sse2"]) == ""
    epyc = {"cpu": "AMD EPYC", "cores": 2}
    assert machine_kind(dict(epyc, isa="AVX2")) != machine_kind(dict(epyc, isa="AVX-512"))
    assert machine_kind(epyc) == "AMD EPYC", "a record from before the ISA was kept"
    here = machine()
    assert here["cpu"] in machine_kind(here)


def test_throughput_is_compared_only_between_runs_on_one_kind_of_machine():
    """The project's machines changed kind between sessions: an O2/O0 throughput ratio across two CPUs says
    nothing about AMP, so the row names each run's CPU and compares only on one."""
    def row(recipe, throughput, cpu):
        run = {"value": 91.0, "throughput": throughput, "device": "CPU", "amp": "x", "protocol": "final checkpoint",
               "steps": 10, "overflow_steps": 0, "wall_time_s": 60.0, "machine": cpu}
        return {"recipe": recipe, "level": recipe[-2:].upper(), "group": "fashion_mnist", "data": "/d", "runs": [run],
                "target": {"published": 91.6, "metric": "top1", "published_setting": "s", "source": "src",
                           "parity": 0.5}}

    same = rp.render([row("lenet_fashion_o0", 1000.0, "AMD EPYC"), row("lenet_fashion_o2", 500.0, "AMD EPYC")])
    assert "CPU (AMD EPYC)" in same and "0.50x O0's throughput" in same
    mixed = rp.render([row("lenet_fashion_o0", 1000.0, "Intel Xeon"), row("lenet_fashion_o2", 1500.0, "AMD EPYC")])
    o2 = next(line for line in mixed.splitlines() if "`lenet_fashion_o2`" in line)
    assert "O0's throughput" not in o2 and "throughput not compared: O0 trained on another machine" in o2
    assert "+0.00 vs O0" in o2, "accuracy still compares: it does not depend on the machine"


def test_a_run_from_before_its_recipe_changed_says_so_and_is_not_compared():
    """A recipe's default changed after a run (Multi30k's update size): the record's overrides say how it
    trained, and O2 is compared with O0 only when both trained alike."""
    def row(recipe, value, overrides):
        run = {"value": value, "throughput": 10.0, "device": "CPU", "amp": "x", "protocol": "p", "steps": 10,
               "overflow_steps": 0, "wall_time_s": 60.0, "machine": "AMD EPYC", "overrides": overrides}
        return {"recipe": recipe, "level": recipe[-2:].upper(), "group": "multi30k", "data": "/d", "runs": [run],
                "target": {"published": 41.02, "metric": "bleu", "published_setting": "s", "source": "s",
                           "parity": 1.0}}

    table = rp.render([row("tiny_o0", 40.5, []), row("tiny_o2", 38.8, ["trainer.update_freq=1"])])
    o2 = next(line for line in table.splitlines() if "`tiny_o2`" in line)
    assert "trained with trainer.update_freq=1" in o2 and "not compared with O0: trained at another setting" in o2
    assert "vs O0" not in o2
    alike = rp.render([row("tiny_o0", 40.5, []), row("tiny_o2", 38.8, [])])
    assert "-1.70 vs O0, OUTSIDE ±1.0" in alike


def test_an_unfinished_run_is_recorded_and_outlives_its_run_directory(tmp_path, fake_runner, monkeypatch):
    """A long run's machine may not come back: where it got to, and its test curve so far, stay in
    reproduce.json (committed), and the table then says the run starts anew rather than continues."""
    data = tmp_path / "fashion"
    data.mkdir()
    seeds(monkeypatch, lenet_fashion_o2=[1])
    run_dir = tmp_path / "runs" / "lenet_fashion_o2-s1"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "lenet5-e0002-s00001874.ckpt").write_bytes(b"")
    (run_dir / "eval_history.jsonl").write_text("".join(
        json.dumps({"epoch": e, "step": 937 * e, "top1": 0.85 + e / 100}) + "\n" for e in (1, 2)))
    args = dict(recipes=["lenet_fashion_o2"], given={"fashion_mnist": str(data)}, runs=tmp_path / "runs",
                out=tmp_path / "out", runner=fake_runner, readme=None, only=[])
    live = next(line for line in rp.reproduce(**args)["table"].splitlines() if "`lenet_fashion_o2`" in line)
    assert "epoch 2, step 1,874, test top1 87.00 at step 1,874 (`make reproduce` continues it)" in live
    record = json.loads((tmp_path / "out" / "reproduce.json").read_text())["unfinished"]["lenet_fashion_o2-s1"]
    assert record["curve"] == [[937, 86.0], [1874, 87.0]] and record["step"] == 1874

    shutil.rmtree(run_dir)  # the machine went away
    gone = next(line for line in rp.reproduce(**args)["table"].splitlines() if "`lenet_fashion_o2`" in line)
    assert "epoch 2, step 1,874, test top1 87.00" in gone and "starts it anew" in gone
    assert "continues it" not in gone
    assert (tmp_path / "out" / "curves_lenet_fashion.png").is_file(), "its curve is still plotted"

    args["only"] = None  # make reproduce: the run starts anew, finishes, and is no longer unfinished
    done = next(line for line in rp.reproduce(**args)["table"].splitlines() if "`lenet_fashion_o2`" in line)
    assert len(fake_runner.calls) == 1 and "unfinished:" not in done and "**90.10**" in done
    assert json.loads((tmp_path / "out" / "reproduce.json").read_text())["unfinished"] == {}


def test_a_scorer_that_fails_keeps_the_run_and_scores_it_next_time(tmp_path, fake_runner, monkeypatch, capsys):
    """bench.multi30k failing after a 5-hour run is one line, not a traceback; the finished run is kept and the
    next reproduce scores it without training it again."""
    import subprocess
    data = tmp_path / "multi30k"
    data.mkdir()
    seeds(monkeypatch, transformer_tiny_multi30k_o0=[1])

    def failing(run_dir):
        raise subprocess.CalledProcessError(1, f"python -m bench.multi30k {run_dir}")
    args = dict(recipes=["transformer_tiny_multi30k_o0"], given={"multi30k": str(data)}, runs=tmp_path / "runs",
                out=tmp_path / "out", runner=fake_runner, readme=None)
    rp.reproduce(**args, scorer=failing)
    assert "scoring failed (python -m bench.multi30k" in capsys.readouterr().out
    test = {"bleu_lowercase": 40.5, "bleu": 40.1}
    def scored(run_dir):
        return {"averaged_test_2016_flickr": test, "averaged_val": test, "averaged": list(range(10)), "beam": 5}
    table = rp.reproduce(**args, scorer=scored)["table"]
    assert len(fake_runner.calls) == 1, "the finished run is not trained again"
    assert "**40.50**" in next(line for line in table.splitlines() if "`transformer_tiny_multi30k_o0`" in line)


def test_a_lowercase_run_is_shown_with_the_papers_scorer_and_its_updates(tmp_path, fake_runner, monkeypatch):
    """The published Multi30k setting writes lowercase and accumulates 2 batches an update: its row gives the
    paper's scorer (bleu_moses_lc) beside sacrebleu's, not a cased score of lowercase output, and its updates."""
    data = tmp_path / "multi30k"
    data.mkdir()
    seeds(monkeypatch, transformer_tiny_multi30k_o2=[1])

    def runner(cmd, log):
        code = fake_runner(cmd, log)
        run_dir = rp.Path(dict(a.split("=", 1) for a in cmd[2:] if "=" in a)["hydra.run.dir"])
        (run_dir / "config.yaml").write_text("trainer: {update_freq: 2}\ndataset: {params: {lowercase: true}}\n")
        return code
    test = {"bleu_lowercase": 40.61, "bleu": 8.4, "bleu_moses_lc": 40.52}
    def scored(run_dir):
        return {"averaged_test_2016_flickr": test, "averaged_val": test, "averaged": list(range(10)), "beam": 5}
    table = rp.reproduce(recipes=["transformer_tiny_multi30k_o2"], given={"multi30k": str(data)},
                         runs=tmp_path / "runs", out=tmp_path / "out", runner=runner, readme=None,
                         scorer=scored)["table"]
    row = next(line for line in table.splitlines() if "`transformer_tiny_multi30k_o2`" in line)
    assert "**40.61**; paper's scorer 40.52, val 40.61" in row and "cased" not in row
    assert "18,740 steps (9,370 updates of 2)" in row


def test_a_signal_while_scoring_says_the_run_is_kept(tmp_path, fake_runner, monkeypatch):
    """A stop signal while bench.multi30k decodes (minutes) ends reproduce with a line that says the run is
    trained and the same command scores it, not 'nothing was written'."""
    import signal

    from ampzoo.interrupt import Interrupted
    data = tmp_path / "multi30k"
    data.mkdir()
    seeds(monkeypatch, transformer_tiny_multi30k_o0=[1])

    def stopped(run_dir):
        raise Interrupted(signal.SIGTERM)
    with pytest.raises(Interrupted) as info:
        rp.reproduce(recipes=["transformer_tiny_multi30k_o0"], given={"multi30k": str(data)}, runs=tmp_path / "runs",
                     out=tmp_path / "out", runner=fake_runner, readme=None, scorer=stopped)
    assert info.value.note.startswith("transformer_tiny_multi30k_o0-s1 is trained and kept"), info.value.note


def test_a_reproduce_that_reproduced_nothing_says_so(tmp_path, capsys):
    """--only RECIPE without its data printed "plan: 0 runs to train" and the table, exit 0: it is exit 1 naming
    the --data to give."""
    with pytest.raises(SystemExit) as e:
        rp.main(["--only", "lenet_o0", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert e.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: not reproduced, for want of its data: lenet_o0; give --data mnist=PATH")


def test_a_run_recorded_elsewhere_is_trained_again_here_and_shown_until_then(tmp_path, fake_runner, monkeypatch):
    """The committed runs counted as done on any machine with the data (issue 80, item 5): reproduce plans and
    trains them again on today's code, and the table shows the committed record until the new run replaces it."""
    data = tmp_path / "fashion"
    data.mkdir()
    seeds(monkeypatch, lenet_fashion_o0=[1, 2])
    out = tmp_path / "out"
    out.mkdir()
    shipped = json.loads((rp.DEFAULT_OUT / "reproduce.json").read_text())["runs"]["lenet_fashion_o0-s1"]
    committed = dict(shipped, data=str(data))  # the committed record, as if its data were this machine's
    (out / "reproduce.json").write_text(json.dumps({"runs": {"lenet_fashion_o0-s1": committed}}))
    args = dict(recipes=["lenet_fashion_o0"], given={"fashion_mnist": str(data)}, runs=tmp_path / "runs", out=out,
                runner=fake_runner, readme=None)
    table = rp.reproduce(**args, plan_only=True)["table"]
    assert len(fake_runner.calls) == 0 and f"{shipped['value']:.2f}" in table, "--plan: the committed run, untrained"
    rp.reproduce(**args, max_seeds=1)
    assert len(fake_runner.calls) == 1 and "runtime.seed=1" in fake_runner.calls[0], "trained again here"
    rp.reproduce(**args)
    assert len(fake_runner.calls) == 2, "seed 1 is done now, seed 2 is trained"
