"""Export a checkpoint for deployment:  python export.py recipe=NAME checkpoint=PATH [infer.format=MINDIR|ONNX]
                                      python export.py weights=NAME (a shipped weight) [...]
[infer.fuse_conv_bn=true] [output=PATH]

Builds the recipe's network under its precision policy, loads the weights, optionally folds Conv+BN, and
writes it with `mindspore.export`; the input shapes are those of one real test batch (batch dimension
`infer.batch_size`). Default output: next to the checkpoint, <checkpoint>.<format lower-case>.
"""
from zoo.entry import run  # first: a command's start-up, before MindSpore loads

import sys
from pathlib import Path

import mindspore as ms

from data import create_dataset
from engine.checkpoint import inference_network
from engine.weights import checkpoint_config
from zoo.errors import ConfigError
from zoo.paths import check_writable


def export(cfg) -> Path:
    # runtime.cpu_kernels=off: the exported graph holds MindSpore's Conv2D, not a call into this machine's .so
    net, cfg, notes, _ = inference_network(cfg, "export.py", cpu_kernels="off")
    for note in notes:
        print(note, file=sys.stderr)
    batch = next(create_dataset(cfg.dataset, "test").create_tuple_iterator())
    inputs = [x[: cfg.infer.batch_size] for x in batch[:-1]]
    fmt = str(cfg.infer.format)
    out = output_path(cfg)
    partial = out.with_name(f".{out.stem}.partial")  # MindSpore adds the format's suffix; renamed once complete
    written = partial.with_name(f"{partial.name}.{'mindir' if fmt == 'MINDIR' else fmt.lower()}")
    try:
        ms.export(net, *inputs, file_name=str(partial), file_format=fmt)
        written.replace(out)
    except OSError as e:
        raise ConfigError(f"could not write {out}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001  (each format's exporter raises its own errors)
        raise ConfigError(f"infer.format={fmt} export failed on this MindSpore build: "
                          f"{str(e).strip().splitlines()[0]}; MINDIR is supported everywhere") from None
    finally:
        written.unlink(missing_ok=True)  # a failed or interrupted export leaves no partial file
    return out


def output_path(cfg) -> Path:
    return Path(cfg.output or f"{cfg.checkpoint}.{str(cfg.infer.format).lower()}").expanduser()


def main(argv) -> None:
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("infer.format=")), "MINDIR")
    cfg, _ = checkpoint_config(argv, f".{fmt.lower()}")
    check_writable(output_path(cfg), "output")  # before the network is built
    out = export(cfg)
    print(f"exported {cfg.recipe_name} to {out}")


if __name__ == "__main__":
    run(main)
