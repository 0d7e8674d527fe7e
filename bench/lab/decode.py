"""Decoding speed and exactness on a trained Transformer checkpoint.

    python -m bench.lab.decode RUN_DIR [--check 32] [key=value ...]

RUN_DIR is a translation run (config.yaml, checkpoints/); its newest checkpoint is decoded, under the run's
config with any key=value given over it (`amp.level=O0`: an O2 run's fp32 weights decoded in fp32, as a CPU
would serve them; fp16 on a CPU only adds casts). Reports, on the
test split: sentences/s and tokens/s for greedy and for beam search at the recipe's beam (5 for
Transformer-Tiny), with BLEU; and, on the first `--check` test sentences, whether the incremental decoder's
hypotheses equal the full-recompute reference's (ampzoo/models/decoding.py) at beam 1 and beam 4. Written to
bench/results/decode.json.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import time
from pathlib import Path

import mindspore as ms
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ampzoo.compose import one_line
from ampzoo.data.translation import encode_pairs, params
from ampzoo.engine.rundir import load_run_config
from ampzoo.errors import fail
from bench.common import pop_option, save_result, trained_network
from ampzoo.models.decoding import (IncrementalDecoder, beam_search, decode_batches, full_recompute_step, greedy,
                                    translate)


def main(argv) -> dict:
    check, argv = pop_option(argv, "--check", 32)
    overrides = [a for a in argv if "=" in a]
    argv = [a for a in argv if "=" not in a]
    if len(argv) != 1 or not (Path(argv[0]) / "config.yaml").is_file():
        fail(f"give one run directory holding config.yaml and checkpoints/; got {argv or 'nothing'}")
    run_dir = Path(argv[0])
    try:
        cfg = OmegaConf.merge(load_run_config(run_dir), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as e:  # an unknown key or a bad value, in one line
        fail(f"overrides {overrides}: {one_line(e)}")
    ckpts = sorted((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not ckpts:
        fail(f"no checkpoint in {run_dir / 'checkpoints'}")
    net = trained_network(cfg, ckpts[-1])
    result = {"run": str(run_dir), "checkpoint": ckpts[-1].name, "recipe": cfg.recipe_name, "overrides": overrides,
              "decode_batch_size": cfg.decode.batch_size, "speed": {}}
    for beam in (1, cfg.decode.beam):
        translate(net, cfg, "test", beam, cfg.decode.length_penalty)  # compile every bucket's graphs first
        t0 = time.perf_counter()
        record = translate(net, cfg, "test", beam, cfg.decode.length_penalty)
        record["wall_s"] = round(time.perf_counter() - t0, 2)
        result["speed"][f"beam {beam}"] = record
        print(f"beam {beam}: {record['sentences']} sentences in {record['decode_s']} s "
              f"({record['sentences_per_s']} sentences/s, {record['tokens_per_s']} tokens/s), "
              f"BLEU {record['bleu_lowercase']:.2f} lowercased", flush=True)

    examples, _, _ = encode_pairs(cfg.dataset, "test")
    p = params(cfg.dataset)
    form = str(cfg.decode.length_norm)
    result["exactness"] = {}
    for beam in (1, 4):
        same = total = 0
        for take, src in decode_batches(examples[:check], 16):
            ms.set_context(mode=ms.GRAPH_MODE)
            got = IncrementalDecoder(net, beam).search(src, cfg.decode.length_penalty, form, p["max_len"])
            ms.set_context(mode=ms.PYNATIVE_MODE)  # the reference runs the decoder eagerly, step by step
            step = full_recompute_step(net, src, beam, p["max_len"], 2 * beam)
            want = (beam_search(step, len(src), beam, p["max_len"], cfg.decode.length_penalty, form) if beam > 1
                    else greedy(step, len(src), p["max_len"]))
            same += sum(a == b for a, b in zip(got[:len(take)], want[:len(take)]))
            total += len(take)
        result["exactness"][f"beam {beam}"] = {"sentences": total, "identical": same}
        print(f"beam {beam}: incremental = full recompute for {same} of {total} sentences", flush=True)
    save_result("decode", result)
    return result


if __name__ == "__main__":
    run(main)
