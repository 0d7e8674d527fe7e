"""Shipped weights: every file matches its manifest entry (sha256, bytes, parameter count, inference weights
only), loading by name checks the sha256 first, a corrupt copy or a weight of another recipe is one line, and
bench.verify gets a LeNet weight's number back from the file."""
import json
import re
import shutil
from pathlib import Path

import pytest

import mindspore as ms
from omegaconf import OmegaConf

from bench.reproduce import data_groups
from bench.verify import data_here, verify
from tests.conftest import ROOT, run_cli
from ampzoo.compose import compose
from ampzoo.engine.load import flatten
from ampzoo.engine.weights import FIELDS, WEIGHTS, find, read_manifest, sha256
from ampzoo.errors import ConfigError

ENTRIES = read_manifest()
FASHION = "apt-get install dataset-fashion-mnist"


def test_weights_are_shipped_for_the_published_numbers():
    assert {"lenet_fashion_o0", "lenet_fashion_o2", "lenet_fashion_o3"} <= set(ENTRIES)


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_every_weight_matches_its_manifest_entry(name):
    entry = ENTRIES[name]
    assert set(FIELDS) <= set(entry), f"missing: {set(FIELDS) - set(entry)}"
    path = WEIGHTS / entry["file"]
    assert sha256(path) == entry["sha256"] and path.stat().st_size == entry["bytes"]
    params = ms.load_checkpoint(str(path))
    assert not any(k.startswith(("moments", "amp_", "scale_sense", "global_step", "learning_rate")) for k in params), \
        "inference weights only: no optimizer or loss-scale state"
    assert sum(p.size for k, p in params.items() if "moving_" not in k) == entry["parameters"], \
        "trainable parameters, as torchvision counts them (BatchNorm running statistics apart)"
    assert entry["command"].startswith(f"python eval.py weights={name}") and entry["published"]["source"]
    folder = re.search(r"dataset\.path=/data/(\S+)", entry["command"])
    assert folder is None or data_groups(folder[1]) == [folder[1]], "the data's own folder, not a preparation's"
    assert not any(o.startswith("dataset.path=") for o in entry["overrides"]), "where the data was is no setting"
    assert {"top1", "top5", "scorer"} <= set(entry["metric"]) or "bleu_lowercase" in entry["metric"]


def test_an_unknown_name_is_one_line_with_the_shipped_ones():
    with pytest.raises(ConfigError, match=r"weights=lenet_fashon_o0 is not a shipped weight; did you mean "
                                          r"lenet_fashion_o0"):
        find("lenet_fashon_o0")


def test_a_corrupt_copy_is_refused_before_loading(tmp_path):
    copy = tmp_path / "weights"
    shutil.copytree(WEIGHTS, copy)
    path = copy / ENTRIES["lenet_fashion_o0"]["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    out = run_cli("eval.py", f"weights={path}")
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"error: weights={path}: {path} fails its sha256 check"), out.stderr
    path.unlink()
    missing = run_cli("eval.py", f"weights={path}")
    assert missing.returncode == 2 and "is missing" in missing.stderr and "Traceback" not in missing.stderr


def test_a_weight_of_another_recipe_is_refused():
    out = run_cli("eval.py", "weights=lenet_fashion_o0", "recipe=lenet_o2")
    assert out.returncode == 2
    assert "weights lenet_fashion_o0 were trained with the recipe lenet_fashion_o0" in out.stderr


def test_verify_gets_a_lenet_weights_number_back():
    if data_here(ENTRIES["lenet_fashion_o2"]) is None:
        pytest.skip(f"needs Fashion-MNIST: {FASHION}")
    [row] = verify(["lenet_fashion_o2"])
    assert row["ok"], row


def test_eval_by_name_writes_outside_the_repository(tmp_path):
    """From any directory: the result goes to ./runs/weights/, not into weights/ of the checkout."""
    if data_here(ENTRIES["lenet_fashion_o0"]) is None:
        pytest.skip(f"needs Fashion-MNIST: {FASHION}")
    out = run_cli(str(ROOT / "eval.py"), "weights=lenet_fashion_o0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "weights lenet_fashion_o0: sha256 verified" in out.stderr
    record = json.loads(out.stdout.splitlines()[-2])
    assert record["top1"] == pytest.approx(ENTRIES["lenet_fashion_o0"]["metric"]["top1"], abs=2e-4)
    assert sorted(p.name for p in WEIGHTS.glob("*.json")) == ["MANIFEST.json"]
    assert json.loads((tmp_path / "runs/weights/lenet_fashion_o0.eval.json").read_text())["split"] == "test"


def test_a_weight_takes_any_key_of_its_own_recipe(tmp_path):
    """eval.py weights=NAME key=value: the keys are the weight's recipe's (another split, beam, length penalty),
    not the default recipe's, without recipe=; the result file names the split, so the test split's stays, and the
    keys that change what is evaluated (where the data is changes nothing)."""
    from ampzoo.engine.weights import checkpoint_config
    from eval import result_path, split_of

    name = "transformer_tiny_multi30k_o0_bpe8k"
    argv = [f"weights={name}", f"dataset.path={tmp_path}", "dataset.params.test_prefix=val", "decode.beam=4",
            "decode.length_penalty=0.6"]
    cfg, _ = checkpoint_config(argv)
    assert (cfg.recipe_name, cfg.dataset.params.test_prefix, cfg.decode.beam, cfg.decode.length_penalty) == (
        ENTRIES[name]["recipe"], "val", 4, 0.6)
    assert result_path(cfg, argv) == Path("runs", "weights", f"{name}.decode.beam-4,decode.length_penalty-0.6."
                                                             f"val.eval.json") and split_of(cfg) == "val"
    assert result_path(cfg, argv[:3]) == Path("runs", "weights", f"{name}.val.eval.json")
    test, _ = checkpoint_config(argv[:2])
    assert result_path(test, argv[:2]) == Path("runs", "weights", f"{name}.test_2016_flickr.eval.json")
    with pytest.raises(ConfigError, match="recipe=lenet_o2, but weights transformer_tiny_multi30k_o0_bpe8k were"):
        checkpoint_config([*argv, "recipe=lenet_o2"])


def test_the_summary_line_leads_with_the_recipes_target_metric():
    from eval import summary

    result = {"top1": 0.55, "top5": 0.68, "loss": 2.5, "bleu": 8.42, "bleu_lowercase": 41.04, "bleu_moses_lc": 41.1}
    line = summary(result, "bleu_lowercase")
    assert line.startswith("BLEU 41.04 lowercased (sacrebleu 13a, detokenized)  BLEU 41.10 lowercased Moses tokens "
                           "(multi-bleu.perl, the paper's scorer)"), line
    assert line.index("BLEU 8.42 cased") < line.index("top-1 55.00%")
    assert summary({"top1": 0.911, "top5": 0.99, "loss": 0.24}, "top1").startswith("top-1 91.10%  top-5 99.00%")


def test_a_translation_weight_brings_its_own_tokenizer(tmp_path):
    """bench.ship puts a translation run's sentencepiece model beside its weights (NAME.spm.model, sha256 in the
    manifest); a weight found by name uses that model, and a changed or missing one is refused before loading."""
    from ampzoo.engine.weights import weights_config

    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "t.ckpt").write_bytes(b"weights")
    (folder / "t.spm.model").write_bytes(b"tokenizer")
    entry = {"file": "t.ckpt", "sha256": sha256(folder / "t.ckpt"), "recipe": "transformer_base_o2",
             "overrides": [], "command": "python eval.py weights=t dataset.path=/data/wmt14",
             "tokenizer": {"file": "t.spm.model", "sha256": sha256(folder / "t.spm.model")}}
    (folder / "MANIFEST.json").write_text(json.dumps({"t": entry}))
    argv = [f"weights={folder / 't.ckpt'}"]
    with pytest.raises(ConfigError, match=r"transformer_base_o2 needs its data; give dataset.path=FOLDER"):
        weights_config(argv)  # not the smoke data: it would score nonsense
    argv.append(f"dataset.path={tmp_path}")
    out, note = weights_config(argv)
    assert out.dataset.params.spm_model == str(folder / "t.spm.model") and note.startswith("weights t: sha256")
    assert out.decode.average_last == 1, "a shipped translation weight is averaged already: it is loaded alone"
    (folder / "t.spm.model").write_bytes(b"changed")
    with pytest.raises(ConfigError, match="t.spm.model fails its sha256 check"):
        find(str(folder / "t.ckpt"))
    (folder / "t.spm.model").unlink()
    with pytest.raises(ConfigError, match="t.spm.model is missing"):
        find(str(folder / "t.ckpt"))


def test_a_weight_shipped_in_fp16_loads_into_the_fp32_network(tmp_path):
    """bench.ship --fp16 halves a large model's file; eval.py loads it into the recipe's fp32 network."""
    import numpy as np

    from ampzoo.engine.checkpoint import load_weights
    from ampzoo.models import create_model

    net = create_model("lenet5", num_classes=10)
    half = [{"name": p.name, "data": ms.Tensor(p.asnumpy()).astype(ms.float16)} for p in net.get_parameters()]
    ms.save_checkpoint(half, str(tmp_path / "half.ckpt"))
    fresh = create_model("lenet5", num_classes=10)
    load_weights(fresh, tmp_path / "half.ckpt", "lenet5")
    for a, b in zip(net.get_parameters(), fresh.get_parameters()):
        assert b.dtype == ms.float32, b.name
        np.testing.assert_allclose(b.asnumpy(), a.asnumpy().astype(np.float16).astype(np.float32), err_msg=b.name)


def test_verify_finds_a_weights_data_where_it_is_given(tmp_path):
    """A manifest names no machine's data path: make verify finds a translation weight's data from --data
    GROUP=PATH (as make reproduce), and says "no data here" rather than scoring the smoke data."""
    name = next(n for n, e in ENTRIES.items() if e["recipe"].startswith("transformer_tiny_multi30k"))
    assert data_here(ENTRIES[name], {"multi30k": str(tmp_path)}) == str(tmp_path.resolve())
    assert data_here(ENTRIES[name], {"multi30k": str(tmp_path / "absent")}) is None
    published = ENTRIES["transformer_tiny_multi30k_o0_bpe8k"]  # dataset=multi30k_published reads multi30k's files
    assert data_here(published, {"multi30k": str(tmp_path)}) == str(tmp_path.resolve())
    out = run_cli("-m bench.verify", "--data", "multi31k=/x")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "error: --data multi31k=...: 'multi31k' is not a dataset group; did you mean multi30k")


def test_ship_records_a_group_options_keys_so_they_compose_back():
    """A run trained at setting=cased_4k lacks keys the recipe has (dataset.params.lowercase), and one trained
    with +key=value has a key the recipe lacks: the manifest's overrides remove (~) and add (+) them, so that
    eval.py weights=NAME composes the run's config again."""
    from bench.ship import overrides

    run = compose(["recipe=transformer_tiny_multi30k_o0", "setting=cased_4k", "trainer.keep_last=100",
                   "+dataset.params.cache_dir=/tmp/spm"])
    found = overrides(run)
    assert {"~dataset.params.lowercase", "~dataset.params.moses", "dataset.params.vocab_size=8000",
            "trainer.update_freq=1", "trainer.keep_last=100", "+dataset.params.cache_dir=/tmp/spm"} <= set(found), found
    again = compose(["recipe=transformer_tiny_multi30k_o0", *found])
    assert plain(again) == plain(run)


def test_ship_leaves_out_the_thread_count():
    """The kernels' thread count changes no number (their pieces are fixed), so a weight trained with
    runtime.cpu_threads=2 does not make eval.py run on 2 threads; the seed, which does change numbers, stays."""
    from bench.ship import overrides

    found = overrides(compose(["recipe=lenet_fashion_o2", "runtime.cpu_threads=2", "runtime.seed=3"]))
    assert found == ["runtime.seed=3"], found


def plain(cfg) -> dict:
    """A composed config as flat key: value, without what says where and how it was composed."""
    return {k: v for k, v in flatten(OmegaConf.to_container(cfg, resolve=True)).items()
            if k.split(".")[0] not in ("recipe_name", "hydra", "target", "smoke", "description")}


@pytest.mark.parametrize("name", [n for n, e in ENTRIES.items() if e["recipe"].startswith("transformer")])
def test_each_transformer_weight_composes_the_config_it_was_trained_with(name):
    """The Multi30k recipes' default moved to the published setting; each manifest entry pins its own setting,
    so its recipe and overrides compose exactly the config it had before (tests/shipped_configs.json: each
    entry composed at commit 1e8c1f2, before the change, with the overrides it trained with; the O2 weight at
    the published setting trained at that commit too), and make verify re-derives its number."""
    before = json.loads((Path(__file__).parent / "shipped_configs.json").read_text())[name]
    entry = ENTRIES[name]
    now = plain(compose([f"recipe={entry['recipe']}", *entry["overrides"]]))
    # keys the schema gained since, none of which changes what these weights decode (cpu_compute: eval.py
    # evaluates fp32 products under auto; the kernels' threads, spin, weight-gradient path and conversions)
    assert set(now) - set(before) <= {"runtime.cpu_kernels", "infer.seq_len", "runtime.cpu_compute",
                                      "dataset.eval_split", "runtime.cpu_threads", "runtime.cpu_pool_spin_us",
                                      "runtime.cpu_weight_grad", "runtime.cpu_half_isa"}
    assert {k: now.get(k) for k in before} == before


def test_a_head_for_another_class_count_starts_fresh(tmp_path):
    """train.py weights=/checkpoint=: every parameter comes from the file but a head of another class count,
    which keeps its initialisation; a model of another width is refused in one line."""
    import numpy as np

    from ampzoo.engine.checkpoint import initial_weights
    from ampzoo.models import create_model

    ten = create_model("lenet5", num_classes=10)
    ms.save_checkpoint(ten, str(tmp_path / "ten.ckpt"))
    three = create_model("lenet5", num_classes=3)
    head = {p.name: p.asnumpy().copy() for p in three.get_parameters()}
    fresh = initial_weights(three, tmp_path / "ten.ckpt", "lenet5", 3)
    assert fresh and all(n.startswith("fc3.") for n in fresh), fresh
    for p, q in zip(three.get_parameters(), ten.get_parameters()):
        np.testing.assert_array_equal(p.asnumpy(), head[p.name] if p.name in fresh else q.asnumpy(), err_msg=p.name)
    with pytest.raises(ConfigError, match="does not fit model 'resnet18'"):
        initial_weights(create_model("resnet18", num_classes=10), tmp_path / "ten.ckpt", "resnet18", 10)


@pytest.mark.parametrize("recipe", ["lenet_fashion_o2", "lenet_o2"])
def test_train_starts_from_a_shipped_weight(tmp_path, recipe):
    """train.py recipe=R weights=NAME initialises from the weight (not a resume): five steps on Fashion-MNIST
    keep the weight's accuracy, which from scratch takes epochs; a MNIST LeNet (10 classes) takes it too."""
    if recipe == "lenet_fashion_o2" and data_here(ENTRIES["lenet_fashion_o2"]) is None:
        pytest.skip(f"needs Fashion-MNIST: {FASHION}")
    run = tmp_path / "run"
    out = run_cli("train.py", f"recipe={recipe}", "weights=lenet_fashion_o2", "trainer.max_steps=5",
                  "logger.progress_bar=false", f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    log = (run / "train.log").read_text()
    assert "initialised from weights lenet_fashion_o2 (sha256 verified); optimizer and schedule start fresh" in log
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 5
    if recipe == "lenet_fashion_o2":
        assert metrics["final"]["top1"] > 0.85, metrics["final"]  # the weight's 91%, not a 5-step net's


def test_train_refuses_what_it_would_ignore(tmp_path):
    out = run_cli("train.py", "recipe=lenet_o0", "output=x.json", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2 and "output is for eval.py and export.py" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("saved,wanted", [(1, 3), (3, 1)])
def test_a_first_convolution_is_adapted_to_the_datas_channels(tmp_path, saved, wanted):
    """A 1-channel weight (every shipped image weight) starts a 3-channel network, and the reverse, as timm's
    adapt_input_conv: the same grey image, replicated to RGB, gives the same logits through both networks."""
    import numpy as np

    from ampzoo.engine.checkpoint import initial_weights
    from ampzoo.models import create_model

    ms.set_seed(0)
    source = create_model("lenet5", num_classes=10, in_channels=saved)
    ms.save_checkpoint(source, str(tmp_path / "w.ckpt"))
    target = create_model("lenet5", num_classes=10, in_channels=wanted)
    assert initial_weights(target, tmp_path / "w.ckpt", "lenet5", 10) == []
    grey = np.random.RandomState(0).rand(2, 1, 32, 32).astype(np.float32)
    def given(n):
        return ms.Tensor(np.repeat(grey, n, axis=1))
    np.testing.assert_allclose(target(given(wanted)).asnumpy(), source(given(saved)).asnumpy(), rtol=1e-4, atol=1e-5)


def test_train_fine_tunes_a_shipped_1_channel_weight_on_rgb_images(tmp_path):
    """The README's fine-tune of a shipped Fashion-MNIST ResNet on your own RGB images: it died at its first step
    (the first convolution took 1 channel); now two steps train, and the log says the convolution was adapted."""
    from tests.test_resnet import write_image_folder

    write_image_folder(tmp_path / "images")
    run = tmp_path / "run"
    out = run_cli("train.py", "recipe=resnet18_fashion_o2", "weights=resnet18_fashion_o2", "dataset=imagenet",
                  f"dataset.path={tmp_path / 'images'}", "model.num_classes=2", "model.params.in_channels=3",
                  "dataset.batch_size=2", "dataset.num_workers=1", "trainer.max_steps=2", "logger.progress_bar=false",
                  f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    log = (run / "train.log").read_text()
    assert "stem.0.weight adapted from 1 to 3 input channels" in log, log
    assert json.loads((run / "metrics.json").read_text())["steps"] == 2


def test_verify_that_verified_nothing_says_so(tmp_path):
    """bench.verify exited 0 having verified nothing: a named weight without its data is exit 1 naming what to
    give; a mistyped --data path is one line, exit 2 (it counted as "no data here")."""
    out = run_cli("-m bench.verify", "transformer_tiny_multi30k_o0")  # Multi30k ships in no package
    assert out.returncode == 1, out.stderr[-2000:]
    assert "| transformer_tiny_multi30k_o0 | bleu_lowercase | 39.4972 | no data here | - |" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == ("error: not verified, for want of its data: "
                                                   "transformer_tiny_multi30k_o0; give --data multi30k=PATH")
    out = run_cli("-m bench.verify", "--data", f"multi30k={tmp_path / 'multi30K'}")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: --data multi30k={tmp_path / 'multi30K'}: no such folder; give the folder that holds the multi30k "
        f"files"], out.stderr


def test_eval_by_name_with_an_override_keeps_the_weights_own_result(tmp_path):
    """eval.py weights=NAME amp.level=O0 overwrote runs/weights/NAME.eval.json, and its JSON did not say O0: the
    override is recorded and names a file of its own; where the data is (dataset.path) names none."""
    if data_here(ENTRIES["lenet_fashion_o2"]) is None:
        pytest.skip(f"needs Fashion-MNIST: {FASHION}")
    plain = run_cli(str(ROOT / "eval.py"), "weights=lenet_fashion_o2",
                    f"dataset.path={data_here(ENTRIES['lenet_fashion_o2'])}", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]
    own = tmp_path / "runs" / "weights" / "lenet_fashion_o2.eval.json"
    before = own.read_text()
    assert json.loads(before)["overrides"] == [f"dataset.path={data_here(ENTRIES['lenet_fashion_o2'])}"]
    overridden = run_cli(str(ROOT / "eval.py"), "weights=lenet_fashion_o2", "amp.level=O0", cwd=tmp_path)
    assert overridden.returncode == 0, overridden.stderr[-2000:]
    assert own.read_text() == before
    record = json.loads((tmp_path / "runs" / "weights" / "lenet_fashion_o2.amp.level-O0.eval.json").read_text())
    assert record["overrides"] == ["amp.level=O0"] and record["top1"] > 0.85


def test_a_key_that_changes_the_arithmetic_names_its_own_result_file():
    """eval.py weights=NAME runtime.cpu_compute=bf16 overwrote the weight's own NAME.eval.json though its number
    differs (issue 80, item 4): only the runtime keys that cannot change a number are neutral."""
    from ampzoo.engine.weights import override_tag
    assert override_tag(["weights=lenet_fashion_o2", "runtime.cpu_compute=bf16"]) == "runtime.cpu_compute-bf16"
    for key in ("runtime.cpu_kernels=off", "runtime.device=CPU", "runtime.onednn_isa=AVX2", "runtime.mode=pynative"):
        assert override_tag([key]) == key.replace("=", "-"), key
    assert override_tag(["runtime.device_id=3", "runtime.profile=true", "dataset.path=/data/x"]) == ""


def test_a_shipped_weight_records_the_compute_path_it_trained_with(tmp_path):
    """The manifest names the kernels and products a weight trained with (issue 81, item 4), from its run's
    metrics.json, so a low-precision number says which path made it."""
    from bench.ship import ship
    run_dir = tmp_path / "run"
    done = run_cli("train.py", "recipe=lenet_o2", "trainer.max_steps=5", "logger.progress_bar=false",
                   f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-2000:]
    entry = ship(run_dir, "tiny", folder=tmp_path / "weights")
    compute = json.loads((run_dir / "metrics.json").read_text())["compute"]
    assert entry["compute"] == compute and compute[0]["kernels"] in ("cpu_kernels", "mindspore"), entry["compute"]
    assert json.loads((tmp_path / "weights" / "MANIFEST.json").read_text())["tiny"]["compute"] == compute
