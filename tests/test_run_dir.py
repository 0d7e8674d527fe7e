"""A run directory belongs to one run: a repeated command, a second process, a full disk, a resume with other
settings, an evaluation without recipe= and a resume of a finished run each end in one clear line or the right
behaviour, with nothing lost or silently changed."""
import errno
import hashlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

import mindspore as ms

from ampzoo.engine.checkpoint import RUN_TIMES

from tests.conftest import ROOT, finished_run_dir, run_cli
from ampzoo.engine.load import load_config, user_keys
from ampzoo.engine.rundir import claim, release, resume_config
from ampzoo.errors import ConfigError, WriteError

ARGS = ["recipe=lenet_o0", "trainer.epochs=2", "logger.progress_bar=false"]


def tree_digest(folder):
    """Every file under `folder` with its sha256: equal before and after means nothing changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return finished_run_dir(tmp_path_factory, "done", *ARGS)


def test_a_fresh_start_in_a_used_directory_is_refused_and_changes_nothing(finished_run):
    before = tree_digest(finished_run)
    again = run_cli("train.py", *ARGS, "trainer.epochs=1", "trainer.keep_last=1", f"hydra.run.dir={finished_run}")
    assert again.returncode == 2
    assert again.stderr.strip() == (f"error: {finished_run} already holds a run (lenet_o0, step 250 in 2 "
                                    f"checkpoint(s), finished); continue it with resume=auto, or give another "
                                    f"hydra.run.dir to start anew")
    assert tree_digest(finished_run) == before


def test_resuming_a_finished_run_says_so_and_changes_nothing(finished_run):
    before = tree_digest(finished_run)
    again = run_cli("train.py", *ARGS, f"hydra.run.dir={finished_run}", "resume=auto")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"{finished_run} is finished (250 steps, 2 epochs): nothing to do" in again.stdout
    assert "Traceback" not in again.stderr
    assert {k: v for k, v in tree_digest(finished_run).items() if k != "train.log"} == \
        {k: v for k, v in before.items() if k != "train.log"}, "no config.resume-N.yaml, no new checkpoint"


def test_a_finished_run_names_the_key_that_ended_it(tmp_path):
    """A run cut by trainer.max_steps continues only with a larger max_steps: pointing at trainer.epochs,
    which a user would raise to no effect, was wrong."""
    from ampzoo.engine.start import finished_note
    cut = {"steps": 300, "epochs": 10, "steps_per_epoch": 125}
    assert finished_note(tmp_path, cut, 300) == (
        f"{tmp_path} is finished at step 300 of 1,250 (trainer.max_steps=300, trainer.epochs=10): nothing to do; "
        f"to train it further, resume with a larger trainer.max_steps (0: to the end of trainer.epochs)")
    for max_steps in (0, 2000):  # the epochs ended it
        note = finished_note(tmp_path, {**cut, "steps": 1250}, max_steps)
        assert note.endswith("(1,250 steps, 10 epochs): nothing to do; to train it further, resume with a larger "
                             "trainer.epochs")


def test_a_second_process_is_refused_while_the_first_holds_the_directory(finished_run):
    claim(finished_run)  # this test process stands for a run in progress
    try:
        before = tree_digest(finished_run)
        second = run_cli("train.py", *ARGS, f"hydra.run.dir={finished_run}", "resume=auto")
        assert second.returncode == 2
        assert second.stderr.strip() == (f"error: run directory {finished_run} is in use by process {os.getpid()}: a "
                                         f"directory holds one run at a time; wait for it to end, or give another "
                                         f"directory")
        assert tree_digest(finished_run) == before
    finally:
        release(finished_run)


def test_a_lock_dies_with_its_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from ampzoo.engine.rundir import claim; "
                               f"claim({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
        claim(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    claim(tmp_path)  # no stale lock: the kernel dropped it
    release(tmp_path)


def test_a_resume_takes_the_runs_own_settings(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started, _ = load_config(["recipe=lenet_o2", "amp.loss_scale.type=dynamic"])
    from omegaconf import OmegaConf
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(started, resolve=True))
    plain, _ = load_config(["recipe=lenet_o2", "resume=auto", "trainer.epochs=9"])
    cfg, taken = resume_config(plain, ["recipe", "resume", "trainer.epochs"], run_dir)
    assert str(cfg.amp.loss_scale.type) == "dynamic", "the run's loss scale, not the recipe's fixed one"
    assert cfg.trainer.epochs == 9 and taken == ["resume", "trainer.epochs"], "extending a run is allowed"
    changed, _ = load_config(["recipe=lenet_o2", "resume=auto", "amp.loss_scale.type=fixed"])
    with pytest.raises(ConfigError, match=r"resume: amp.loss_scale.type=fixed would change the run, which has "
                                          r"amp.loss_scale.type=dynamic"):
        resume_config(changed, ["recipe", "resume", "amp.loss_scale.type"], run_dir)
    other, _ = load_config(["recipe=lenet_o0", "resume=auto"])
    with pytest.raises(ConfigError, match="recipe=lenet_o0, but .* holds a lenet_o2 run"):
        resume_config(other, ["recipe", "resume"], run_dir)


def test_a_cpu_run_with_the_kernels_on_resumes_on_another_machine(tmp_path):
    """runtime.cpu_kernels=on refuses a device; a resume there gives auto (or off), and a resume on a CPU without
    bf16 gives runtime.cpu_compute=fp32: neither changes what the checkpoints hold (issue 79, item 6)."""
    from omegaconf import OmegaConf
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started, _ = load_config(["recipe=lenet_o2", "runtime.cpu_kernels=on", "runtime.cpu_compute=bf16"])
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(started, resolve=True))
    given = ["recipe=lenet_o2", "resume=auto", "runtime.cpu_kernels=auto", "runtime.cpu_compute=fp32"]
    cfg, taken = resume_config(load_config(given)[0], user_keys(given), run_dir)
    assert (str(cfg.runtime.cpu_kernels), str(cfg.runtime.cpu_compute)) == ("auto", "fp32")
    assert set(taken) == {"resume", "runtime.cpu_kernels", "runtime.cpu_compute"}
    kept, _ = resume_config(load_config(given[:2])[0], user_keys(given[:2]), run_dir)
    assert (str(kept.runtime.cpu_kernels), str(kept.runtime.cpu_compute)) == ("on", "bf16"), "not given: the run's"


def test_eval_without_recipe_uses_the_runs_config(finished_run, tmp_path):
    ckpt = finished_run / "checkpoints" / "lenet5-e0002-s00000250.ckpt"
    metrics = json.loads((finished_run / "metrics.json").read_text())
    out = run_cli("eval.py", f"checkpoint={ckpt}", f"output={tmp_path / 'e.json'}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "using the config of the run it belongs to: lenet_o0" in out.stderr
    record = json.loads((tmp_path / "e.json").read_text())
    assert record["recipe"] == "lenet_o0" and record["top1"] == pytest.approx(metrics["final"]["top1"])
    wrong = run_cli("eval.py", "recipe=lenet_o2", f"checkpoint={ckpt}")
    assert wrong.returncode == 2 and "belongs to a lenet_o0 run" in wrong.stderr and "Traceback" not in wrong.stderr


def test_bad_input_leaves_no_directory_behind(tmp_path):
    run_dir = tmp_path / "new"
    out = run_cli("train.py", *ARGS, "dataset.batch_size=100000", f"hydra.run.dir={run_dir}")
    assert out.returncode == 2 and out.stderr.strip().startswith("error: dataset.batch_size=100000")
    assert not run_dir.exists()


def test_disk_full_is_one_line_and_the_checkpoints_stay_whole(tmp_path):
    def small_files():  # a file-size limit: the first checkpoint cannot be written, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "train.py", *ARGS, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                         preexec_fn=small_files, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not write {run_dir / 'checkpoints' / 'lenet5-e0001-s00000125.ckpt'}: File "
                           f"too large; every complete checkpoint is intact") and last.endswith(
        f"continue with: python train.py recipe=lenet_o0 hydra.run.dir={run_dir} resume=auto"), out.stderr
    assert "Traceback" not in out.stderr
    assert not list((run_dir / "checkpoints").glob("*.ckpt")) and not list((run_dir / "checkpoints").rglob("*.tmp"))


def weights(path):
    """A checkpoint's training state: every entry but the run's times so far (which differ between two runs)."""
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path)).items() if k not in RUN_TIMES}


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_after_a_failed_save_resume_finishes_with_the_same_weights(tmp_path, monkeypatch, graph_mode):
    from train import train
    from ampzoo.engine import checkpoint as zc
    cfg, _ = load_config(ARGS)
    whole = tmp_path / "whole"
    whole.mkdir()
    train(cfg, whole)

    saves, real_save = [], zc.ms.save_checkpoint

    def disk_fills(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            raise RuntimeError("Failed to save the checkpoint file: No space left on device")
        return real_save(*args, **kwargs)
    monkeypatch.setattr(zc.ms, "save_checkpoint", disk_fills)
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(WriteError, match="lenet5-e0002-s00000250.ckpt: Failed to save the checkpoint file"):
        train(cfg, broken)
    assert [p.name for p in zc.checkpoints(broken / "checkpoints")] == ["lenet5-e0001-s00000125.ckpt"]
    monkeypatch.setattr(zc.ms, "save_checkpoint", real_save)  # space freed
    resumed, _ = load_config([*ARGS, "resume=auto"])
    train(resumed, broken)
    a = weights(whole / "checkpoints" / "lenet5-e0002-s00000250.ckpt")
    b = weights(broken / "checkpoints" / "lenet5-e0002-s00000250.ckpt")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    history = json.loads((broken / "metrics.json").read_text())["eval_history"]
    assert [h["step"] for h in history] == [125, 250], "the evaluation from before the resume is kept"


@pytest.mark.slow  # a long run kept out of make test (make test-all runs it); a cheaper test covers the same path
def test_tensorboard_failing_does_not_stop_a_run(tmp_path, monkeypatch, graph_mode, caplog):
    from tensorboardX import SummaryWriter

    from train import train

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    cfg, _ = load_config([*ARGS, "trainer.epochs=1"])
    with caplog.at_level("WARNING", logger="amp_zoo"):
        train(cfg, tmp_path)
    assert (tmp_path / "metrics.json").exists()
    assert "could not be written (No space left on device); training goes on without them" in caplog.text


def test_progress_labels_after_a_step_budget(tmp_path, graph_mode, caplog):
    from train import train
    cfg, _ = load_config(["recipe=lenet_o0", "trainer.epochs=10", "trainer.max_steps=50", "logger.progress_bar=false"])
    with caplog.at_level("INFO", logger="amp_zoo"):
        train(cfg, tmp_path)
    history = json.loads((tmp_path / "metrics.json").read_text())["eval_history"]
    assert [(h["epoch"], h["step"]) for h in history] == [(0.4, 50)], "no evaluation of the cut epoch as epoch 1"
    assert "epoch 1/1: step 50" in caplog.text


def test_a_resumed_runs_latest_config_is_its_last_process(tmp_path):
    """config.yaml keeps the first process's settings; a resume writes config.resume-N.yaml. What the run
    finished with (bench.ship's overrides) is the newest of those, N counted as a number (10 after 9)."""
    from omegaconf import OmegaConf
    from ampzoo.compose import compose
    from ampzoo.engine.rundir import load_run_config

    cfg = compose(["recipe=lenet_o0"])
    for name, epochs in [("config.yaml", 3), ("config.resume-2.yaml", 5), ("config.resume-10.yaml", 9),
                         ("config.resume-9.yaml", 7)]:
        (tmp_path / name).write_text(OmegaConf.to_yaml(OmegaConf.merge(cfg, {"trainer": {"epochs": epochs}})))
    assert load_run_config(tmp_path).trainer.epochs == 3
    assert load_run_config(tmp_path, latest=True).trainer.epochs == 9


def test_a_run_written_with_a_key_since_removed_still_loads(tmp_path):
    """target.seeds left the schema for bench/reproduce.py's plans: a run directory written before still loads,
    without it, and a free-form block keeps its keys."""
    from omegaconf import OmegaConf

    from ampzoo.compose import compose
    from ampzoo.engine.rundir import load_run_config
    saved = OmegaConf.to_container(compose(["recipe=lenet_o2"]), resolve=False)
    saved["target"]["seeds"] = [1, 2, 3]
    saved["model"]["params"] = {"width": 8}
    OmegaConf.save(OmegaConf.create(saved), tmp_path / "config.yaml")
    cfg = load_run_config(tmp_path)
    assert "seeds" not in cfg.target and cfg.recipe_name == "lenet_o2" and cfg.model.params.width == 8
    assert cfg.model.name == "lenet5" and cfg.dataset.name == saved["dataset"]["name"], "keys without a default"


def test_a_translation_run_keeps_its_tokenizer(tmp_path):
    """The run's token ids come from one sentencepiece model: the run keeps a copy, a resume uses it, and another
    model given to the resume is refused rather than silently changing the ids."""
    from omegaconf import OmegaConf

    from ampzoo.engine.rundir import keep_tokenizer
    model, other = tmp_path / "spm.model", tmp_path / "other.model"
    model.write_bytes(b"first model")
    other.write_bytes(b"another model")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    def cfg(spm):
        return OmegaConf.create({"dataset": {"name": "multi30k", "params": {"spm_model": spm}}})
    later_rank = cfg(str(model))
    keep_tokenizer(later_rank, run_dir, rank=1, resuming=False)  # msrun: rank 0 copies; the others use the model
    assert later_rank.dataset.params.spm_model == str(model) and not (run_dir / "tokenizer.model").exists()
    first = cfg(str(model))
    keep_tokenizer(first, run_dir, rank=0, resuming=False)
    assert (run_dir / "tokenizer.model").read_bytes() == b"first model"
    assert first.dataset.params.spm_model == str((run_dir / "tokenizer.model").resolve())
    resumed = cfg(None)
    keep_tokenizer(resumed, run_dir, rank=0, resuming=True)
    assert resumed.dataset.params.spm_model == first.dataset.params.spm_model
    with pytest.raises(ConfigError, match=r"spm_model=.*other.model is not the tokenizer this run was trained with"):
        keep_tokenizer(cfg(str(other)), run_dir, rank=0, resuming=True)
    anew = cfg(str(other))  # a new run where an earlier start saved no checkpoint: its tokenizer, not the old copy
    keep_tokenizer(anew, run_dir, rank=0, resuming=False)
    assert (run_dir / "tokenizer.model").read_bytes() == b"another model"
    assert anew.dataset.params.spm_model == first.dataset.params.spm_model


def test_a_moved_run_reads_its_own_tokenizer(tmp_path):
    """config.yaml names the run's copy of its tokenizer where the run was; moved elsewhere, everything that reads
    the run (a resume, bench.multi30k, bench.ship) uses the copy where it is now, not a missing or foreign file."""
    from omegaconf import OmegaConf

    from ampzoo.data.translation import tokenizer_file
    from ampzoo.engine.rundir import load_run_config
    started, _ = load_config(["recipe=transformer_base_o2"])
    OmegaConf.update(started, "dataset.params.spm_model", str(tmp_path / "was-here" / "tokenizer.model"),
                     force_add=True)
    run_dir = tmp_path / "moved"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(started, resolve=True))
    (run_dir / "tokenizer.model").write_bytes(b"the run's model")
    for latest in (False, True):
        cfg = load_run_config(run_dir, latest=latest)
        assert tokenizer_file(cfg.dataset) == (run_dir / "tokenizer.model").resolve()


@pytest.mark.parametrize("dataset", ["dataset=multi30k_published", "++dataset.params.spm_model=GIVEN"])
def test_a_resume_that_repeats_the_command_line_keeps_its_tokenizer(tmp_path, dataset):
    """The command that started a translation run, again with resume=auto, continues it: config.yaml names the
    run's copy of its tokenizer, which the command line's `dataset=` group or spm_model is not refused for; a
    tokenizer of other content still is (keep_tokenizer)."""
    from omegaconf import OmegaConf

    from ampzoo.engine.load import user_keys
    from ampzoo.engine.rundir import keep_tokenizer
    given, other = tmp_path / "spm.model", tmp_path / "other.model"
    given.write_bytes(b"the model")
    other.write_bytes(b"another model")
    argv = ["recipe=transformer_base_o2", dataset.replace("GIVEN", str(given))]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started, _ = load_config(argv)
    if not started.dataset.params.get("spm_model"):  # stands for the model cached for the data
        OmegaConf.update(started, "dataset.params.spm_model", str(given), force_add=True)
    keep_tokenizer(started, run_dir, rank=0, resuming=False)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(started, resolve=True))
    again = argv + ["resume=auto"]
    cfg, _ = resume_config(load_config(again)[0], user_keys(again), run_dir)
    keep_tokenizer(cfg, run_dir, rank=0, resuming=True)
    assert cfg.dataset.params.spm_model == str((run_dir / "tokenizer.model").resolve())
    assert cfg.dataset.params.vocab_size == started.dataset.params.vocab_size
    changed = [argv[0], f"++dataset.params.spm_model={other}", "resume=auto"]
    cfg, _ = resume_config(load_config(changed)[0], user_keys(changed), run_dir)
    with pytest.raises(ConfigError, match=r"other.model is not the tokenizer this run was trained with"):
        keep_tokenizer(cfg, run_dir, rank=0, resuming=True)


def test_eval_of_a_translation_checkpoint_uses_the_runs_tokenizer(tmp_path):
    """eval.py / export.py of a train.py checkpoint decode with the tokenizer its run kept, whatever the command
    line's dataset= group says; a spm_model given that is another model is refused (a plausible wrong BLEU)."""
    from omegaconf import OmegaConf

    from ampzoo.engine.load import user_keys
    from ampzoo.engine.rundir import run_config_for
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    started, _ = load_config(["recipe=transformer_base_o2"])
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(started, resolve=True))
    (run_dir / "tokenizer.model").write_bytes(b"the run's model")
    same, other = tmp_path / "same.model", tmp_path / "other.model"
    same.write_bytes(b"the run's model")
    other.write_bytes(b"another model")
    ckpt = run_dir / "checkpoints" / "transformer-e0001-s00000010.ckpt"
    kept = str((run_dir / "tokenizer.model").resolve())
    for extra in ([], ["dataset=multi30k_published"], [f"++dataset.params.spm_model={same}"]):
        argv = [f"checkpoint={ckpt}", *extra]
        cfg, _ = run_config_for(load_config(argv)[0], user_keys(argv))
        assert cfg.dataset.params.spm_model == kept, extra
    argv = [f"checkpoint={ckpt}", f"++dataset.params.spm_model={other}"]
    with pytest.raises(ConfigError, match=r"other.model is not the tokenizer this run was trained with"):
        run_config_for(load_config(argv)[0], user_keys(argv))


def test_a_run_started_from_a_translation_runs_checkpoint_takes_its_tokenizer(tmp_path, caplog):
    """train.py checkpoint=FILE (a fine-tune) of a translation run's checkpoint uses the tokenizer that run kept,
    as weights=NAME uses the weight's: its embeddings are for those token ids, not for a model trained anew."""
    from omegaconf import OmegaConf

    from ampzoo.engine.start import start_from
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(load_config(["recipe=transformer_base_o2"])[0]))
    (run_dir / "tokenizer.model").write_bytes(b"the run's model")
    ckpt = run_dir / "checkpoints" / "transformer-e0001-s00000010.ckpt"
    ckpt.write_bytes(b"weights")
    cfg, init = start_from(load_config(["recipe=transformer_base_o2", f"checkpoint={ckpt}"])[0])
    assert cfg.dataset.params.get("spm_model") == str((run_dir / "tokenizer.model").resolve()) and init[0] == ckpt
    mine = tmp_path / "mine.model"
    mine.write_bytes(b"another model")
    with caplog.at_level(logging.WARNING, logger="amp_zoo"):
        cfg, _ = start_from(load_config(["recipe=transformer_base_o2", f"checkpoint={ckpt}",
                                               f"++dataset.params.spm_model={mine}"])[0])
    assert cfg.dataset.params.spm_model == str(mine), "a tokenizer given is the user's choice"
    assert "mine.model is not the tokenizer of the checkpoint" in caplog.text, "and it is said, not silent"
