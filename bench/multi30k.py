"""Score a Multi30k training run from its checkpoints: the val BLEU curve per epoch, then the published protocol.

    python -m bench.multi30k RUN_DIR [--curve-beam 1] [--curve-every 1] [--no-final] [--no-curve]

RUN_DIR is a `train.py recipe=transformer_tiny_multi30k_*` run directory (its config.yaml and checkpoints/).
1. Every epoch checkpoint not scored yet: val BLEU (greedy unless --curve-beam), lowercased and cased, into
   RUN_DIR/multi30k_curve.json and a plot, multi30k_curve.png. Resumable: scored epochs are kept.
2. The published protocol: the last `decode.average_last` epoch checkpoints averaged, beam `decode.beam`,
   length penalty as the recipe says; test_2016_flickr and val, lowercased (the comparable number) and
   cased; the last checkpoint alone beside it. Written to RUN_DIR/multi30k_result.json.
--no-curve skips step 1 (the final number first, the curve in a later call); --no-final skips step 2.
--curve-every K scores every K-th epoch and the last (each score is a greedy pass over val).
Decoding is incremental (ampzoo/models/decoding.py); sentences/s and tokens/s are in each record.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import json
from pathlib import Path

from omegaconf import OmegaConf

from ampzoo.cli import pop_flag, pop_option
from ampzoo.data import create_dataset
from ampzoo.engine.checkpoint import average_checkpoints, epoch_checkpoints, load_weights
from ampzoo.engine.rundir import load_run_config
from ampzoo.errors import fail
from bench.common import trained_network
from ampzoo.models.decoding import translate


def split_cfg(cfg, prefix: str):
    """The run's config reading `prefix` as its test split."""
    return OmegaConf.merge(cfg, {"dataset": {"params": {"test_prefix": prefix}}})


def plot(lines, out: Path, title: str, xlabel: str = "epoch", ylabel: str = "BLEU (sacrebleu)") -> None:
    """BLEU per epoch: `lines` are (label, curve, key) with curve {epoch: record} as multi30k_curve.json holds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve, key in lines:
        epochs = sorted(int(e) for e in curve)
        ax.plot(epochs, [curve[str(e)][key] for e in epochs], marker=".", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv) -> dict:
    curve_beam, argv = pop_option(argv, "--curve-beam", 1)
    every, argv = pop_option(argv, "--curve-every", 1)
    if every < 1:
        fail(f"--curve-every needs a whole number of epochs >= 1; got {every}")
    no_final, argv = pop_flag(argv, "--no-final")
    no_curve, argv = pop_flag(argv, "--no-curve")
    final, scan = not no_final, not no_curve
    if len(argv) != 1 or not (Path(argv[0]) / "config.yaml").is_file():
        fail(f"give one run directory holding config.yaml and checkpoints/; got {argv or 'nothing'}")
    run_dir = Path(argv[0])
    cfg = load_run_config(run_dir)
    steps_per_epoch = create_dataset(cfg.dataset, "train").get_dataset_size()
    ckpts = epoch_checkpoints(run_dir / "checkpoints", steps_per_epoch)
    if not ckpts:
        fail(f"no epoch checkpoint in {run_dir / 'checkpoints'} yet")
    net = trained_network(cfg, next(iter(ckpts.values())))  # the run's device, mode and policy
    name = cfg.model.name
    val, test = split_cfg(cfg, "val"), split_cfg(cfg, cfg.dataset.params.test_prefix)

    curve_file = run_dir / "multi30k_curve.json"
    curve = json.loads(curve_file.read_text()) if curve_file.is_file() else {}
    for epoch, path in ckpts.items():
        if str(epoch) in curve or not scan or (epoch % every and epoch != max(ckpts)):
            continue
        load_weights(net, path, name)
        record = translate(net, val, "test", curve_beam, cfg.decode.length_penalty)
        curve[str(epoch)] = {"checkpoint": path.name, "step": epoch * steps_per_epoch,
                             "update_freq": cfg.trainer.get("update_freq", 1), **record}
        curve_file.write_text(json.dumps(curve, indent=2))
        print(f"epoch {epoch}: val BLEU {record['bleu_lowercase']:.2f} lowercased, {record['bleu']:.2f} cased "
              f"(beam {curve_beam}, {record['sentences_per_s']} sentences/s)", flush=True)
    if curve:
        plot([("val BLEU, lowercased", curve, "bleu_lowercase"), ("val BLEU, cased", curve, "bleu")],
             run_dir / "multi30k_curve.png", f"{cfg.recipe_name}: val BLEU per epoch (beam {curve_beam})")
    if not final:
        return {"curve": curve}

    n = cfg.decode.average_last
    last = list(ckpts.values())[-n:]
    result = {"recipe": cfg.recipe_name, "epochs": max(ckpts), "steps": max(ckpts) * steps_per_epoch,
              "averaged": [p.name for p in last], "beam": cfg.decode.beam, "length_penalty": cfg.decode.length_penalty,
              "length_norm": str(cfg.decode.length_norm)}
    load_weights(net, last[-1], name, average_checkpoints(last))
    for split, scfg in (("test_2016_flickr", test), ("val", val)):
        result[f"averaged_{split}"] = translate(net, scfg, "test", cfg.decode.beam, cfg.decode.length_penalty,
                                                run_dir / f"hyp.{split}.averaged.de")
    load_weights(net, last[-1], name)
    result["last_test_2016_flickr"] = translate(net, test, "test", cfg.decode.beam, cfg.decode.length_penalty)
    (run_dir / "multi30k_result.json").write_text(json.dumps(result, indent=2))
    t = result["averaged_test_2016_flickr"]
    print(f"test_2016_flickr, last {len(last)} averaged, beam {cfg.decode.beam}: BLEU {t['bleu_lowercase']:.2f} "
          f"lowercased, {t['bleu']:.2f} cased (sacrebleu 13a); {t['bleu_moses_lc']:.2f} on lowercased Moses tokens "
          f"(multi-bleu.perl, the paper's scorer) ({t['sentences_per_s']} sentences/s)")
    return result


if __name__ == "__main__":
    run(main)  # a checkpoint that does not fit, a run directory without data: one line
