"""Hydra's own flags on train.py's command line, in any position: --cfg job|hydra|all (and --cfg=job, -c),
--resolve, --package/-p, --info/-i, -cn/--config-name, -cp/--config-path, -m/--multirun. The slip checker
reads a flag's value as the flag's, not as a key=value override, and a flag that only prints runs nothing."""
import pytest

from tests.conftest import run_cli
from ampzoo.compose import hydra_flags

TINY = "recipe=transformer_tiny_multi30k_o0"


@pytest.mark.parametrize("argv, flags, overrides", [
    (["a=1", "--cfg", "job", "b=2"], ["--cfg=job"], ["a=1", "b=2"]),
    (["-c", "hydra", "a=1", "--resolve"], ["-c=hydra", "--resolve"], ["a=1"]),
    (["--info", "a=1"], ["--info=all"], ["a=1"]),                  # a bare --info before an override
    (["a=1", "-i", "defaults"], ["-i=defaults"], ["a=1"]),
    (["-cn", "config", "a=1", "-cp", "conf", "-p", "trainer"], ["-cn=config", "-cp=conf", "-p=trainer"], ["a=1"]),
    (["a=1,2", "-m"], ["-m"], ["a=1,2"]),
    (["--cfg=job", "~a"], ["--cfg=job"], ["~a"]),
])
def test_a_flags_value_is_the_flags(argv, flags, overrides):
    assert hydra_flags(argv) == (flags, overrides)


@pytest.mark.parametrize("args, shows", [
    ([TINY, "--cfg", "job", "trainer.log_every=7"], ["update_freq: 2", "max_steps: 16000", "lowercase: true",
                                                     "log_every: 7"]),
    (["--cfg", "job", TINY], ["update_freq: 2", "spm_type: bpe"]),
    ([TINY, "--cfg=job"], ["update_freq: 2"]),
    (["-c", "job", "recipe=transformer_tiny_multi30k_o2"], ["update_freq: 2", "level: O2"]),
    (["recipe=lenet_o0", "--cfg", "hydra"], ["hydra:", "run:"]),
    (["--cfg", "all", "recipe=lenet_o0"], ["hydra:", "trainer:"]),
    (["recipe=lenet_o0", "--cfg", "job", "--resolve"], ["recipe_name: lenet_o0"]),
    (["--package", "trainer", "recipe=lenet_o0", "--cfg", "job"], ["epochs: 10"]),
    (["--info", "recipe=lenet_o0"], ["Defaults List", "recipe/lenet_o0"]),
    (["recipe=lenet_o0", "--info", "defaults"], ["Defaults List", "recipe/lenet_o0"]),
    (["-cn", "config", "recipe=lenet_o0", "--cfg", "job", "-p", "trainer"], ["epochs: 10"]),
    (["recipe=lenet_o0", "--config-path", "conf", "--config-name", "config", "-c", "job"], ["epochs: 10"]),
])
def test_hydra_flags_work_in_any_position(tmp_path, args, shows):
    run_dir = tmp_path / "run"
    result = run_cli("train.py", *args, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-1500:]
    for text in shows:
        assert text in result.stdout, (text, result.stdout[:1500])
    assert not run_dir.exists(), "a flag that prints the config trains nothing"


def test_multirun_flag_in_any_position_checks_every_run():
    """-m after the overrides: each run of the sweep is composed and checked before anything starts."""
    result = run_cli("train.py", "recipe=lenet_o0,lenet_o2", "trainer.epochs=0", "-m")
    assert result.returncode == 2 and result.stderr.strip() == "error: trainer.epochs=0 must be at least 1", \
        result.stderr


def test_eval_names_a_hydra_flag_it_would_ignore():
    """eval.py and export.py are no Hydra applications: a flag (or train.py's resume=) there is one line,
    not silently dropped."""
    from ampzoo.engine.weights import checkpoint_config
    from ampzoo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--cfg=job: this command takes key=value overrides only"):
        checkpoint_config(["weights=lenet_fashion_o0", "--cfg", "job"])
    with pytest.raises(ConfigError, match=r"^resume is train.py's"):
        checkpoint_config(["weights=lenet_fashion_o0", "resume=auto"])


def test_the_amp_tools_name_a_hydra_flag_they_would_ignore():
    """amp.report / amp.audit (and anything else that composes through load_config outside train.py) are no
    Hydra applications either: `--cfg job` there is one line, with weights= or without."""
    from ampzoo.engine.load import load_config
    from ampzoo.engine.weights import weights_argv
    from ampzoo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--cfg=job: this command takes key=value overrides only"):
        weights_argv(["weights=lenet_fashion_o3", "--cfg", "job"])
    with pytest.raises(ConfigError, match=r"^--cfg=job: this command takes key=value overrides only"):
        load_config(["recipe=lenet_o2", "--cfg", "job"])
    result = run_cli("-m amp.report", "recipe=lenet_o2", "--cfg", "job")
    assert result.returncode == 2 and result.stderr.startswith("error: --cfg=job: this command takes"), result.stderr


def test_a_recipe_named_by_its_file_is_the_recipe():
    """recipe=lenet_o2.yaml trained into runs/lenet_o2.yaml/, and recipe=recipes/lenet_o2.yaml was "not found"
    (issue 80, item 8): both are recipe=lenet_o2, as tab completion gives the file."""
    from ampzoo.compose import expand_home
    assert expand_home(["recipe=lenet_o2.yaml", "recipe=recipes/lenet_o2.yaml", "recipe=./recipes/lenet_o3.yaml",
                        "recipe=conf/recipe/lenet_o0.yaml", "trainer.epochs=2"]) == \
        ["recipe=lenet_o2", "recipe=lenet_o2", "recipe=lenet_o3", "recipe=lenet_o0", "trainer.epochs=2"]
    from ampzoo.engine.load import load_config
    assert load_config(["recipe=recipes/lenet_o2.yaml"])[0].recipe_name == "lenet_o2"
