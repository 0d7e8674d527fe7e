"""Export a checkpoint for deployment:  python export.py recipe=NAME checkpoint=PATH [infer.format=MINDIR|ONNX]
                                      python export.py weights=NAME (a shipped weight) [...]
[infer.fuse_conv_bn=true] [output=PATH]

Builds the recipe's network under its precision policy, loads the weights, optionally folds Conv+BN, and
writes it with `mindspore.export`; the input shapes are those of one real test batch (batch dimension
`infer.batch_size`). Default output: next to the checkpoint, <checkpoint>.<format lower-case>; an output= named
.onnx or .mindir sets the format (a contradicting infer.format is one line). A Transformer exports its
teacher-forced forward (source and target ids in, logits out) at the first test batch's lengths: the graph does
not decode, and README.md shows the loop that does.
"""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

import mindspore as ms
import numpy as np

from ampzoo.data import create_dataset, task
from ampzoo.engine.checkpoint import inference_network
from ampzoo.engine.weights import checkpoint_config, override_tag
from ampzoo.errors import ConfigError
from ampzoo.paths import check_writable
from ampzoo.models import model_args


def export(cfg) -> Tuple[Path, list]:
    """Writes the file; returns its path and the shapes of the inputs it takes."""
    # runtime.cpu_kernels=off: the exported graph holds MindSpore's Conv2D, not a call into this machine's .so
    net, cfg, notes, _ = inference_network(cfg, "export.py", cpu_kernels="off")
    for note in notes:
        print(note, file=sys.stderr)
    batch = next(create_dataset(cfg.dataset, "test").create_tuple_iterator())
    inputs = [x[: cfg.infer.batch_size] for x in batch[:-1]]
    if cfg.infer.seq_len and task(cfg) == "translation":  # token ids of a fixed length: the shapes are what counts
        longest = model_args(cfg).get("max_len", cfg.infer.seq_len)
        if cfg.infer.seq_len > longest:
            raise ConfigError(f"infer.seq_len={cfg.infer.seq_len} is longer than the model's positions "
                              f"(model.params.max_len={longest}); give at most {longest}")
        inputs = [ms.Tensor(np.zeros((x.shape[0], cfg.infer.seq_len), np.int32)) for x in inputs]
    fmt = str(cfg.infer.format)
    out = output_path(cfg)
    existed = out.exists()
    # MindSpore writes into a folder of our own beside the output: its ONNX writer sets the folder it writes in to
    # 0700 and the file to 0400, which would lock a shared folder's other users out. The file is renamed into
    # place once complete, with the mode any new file of the user's gets (their umask).
    private = Path(tempfile.mkdtemp(prefix=f".{out.stem}.", dir=out.parent))
    written = private / f"{out.stem}.{'mindir' if fmt == 'MINDIR' else fmt.lower()}"
    try:
        ms.export(net, *inputs, file_name=str(written.with_suffix("")), file_format=fmt)
        os.chmod(written, 0o666 & ~current_umask())
        written.replace(out)
    except OSError as e:
        raise ConfigError(f"could not write {out}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001  (each format's exporter raises its own errors)
        raise ConfigError(f"infer.format={fmt} export failed on this MindSpore build: "
                          f"{str(e).strip().splitlines()[0]}; MINDIR is supported everywhere") from None
    finally:
        shutil.rmtree(private, ignore_errors=True)  # a failed or interrupted export leaves no partial file
    if existed:
        print(f"note: replaced the {out.name} that was there", file=sys.stderr)
    return out, [tuple(x.shape) for x in inputs]


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def output_path(cfg, argv: List[str] = ()) -> Path:
    """output= when given; else beside the checkpoint (a shipped weight: runs/weights/NAME), named with the
    overrides that change what is exported (infer.batch_size=8), so that it never replaces the plain export."""
    if any(a.lstrip("+").startswith("output=") for a in argv):
        return Path(cfg.output).expanduser()
    fmt = str(cfg.infer.format).lower()
    default = Path(cfg.output or f"{cfg.checkpoint}.{fmt}").expanduser()
    tag = override_tag([a for a in argv if not a.lstrip("+").startswith("infer.format=")])
    return default.with_name(f"{default.name.removesuffix('.' + fmt)}.{tag}.{fmt}") if tag else default


SUFFIXES = {".mindir": "MINDIR", ".onnx": "ONNX"}


def follow_suffix(argv: List[str]) -> List[str]:
    """The format an output= file name says (.onnx, .mindir) is the one written: infer.format follows it when not
    given, and a format the name contradicts is one line (it wrote a MINDIR file named .onnx, exit 0)."""
    given = next((a.split("=", 1)[1] for a in reversed(argv) if a.lstrip("+").startswith("infer.format=")), None)
    output = next((a.split("=", 1)[1] for a in reversed(argv) if a.lstrip("+").startswith("output=")), None)
    named = SUFFIXES.get(Path(output).suffix.lower()) if output else None
    if named is None:
        return argv
    if given is None:
        return [*argv, f"infer.format={named}"]
    if given.upper() != named:
        raise ConfigError(f"output={output}: its suffix says {named}, but infer.format={given}; drop infer.format "
                          f"(the suffix decides) or name the file {Path(output).stem}.{given.lower()}")
    return argv


def main(argv) -> None:
    argv = follow_suffix(argv)
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("infer.format=")), "MINDIR")
    cfg, _ = checkpoint_config(argv, f".{fmt.lower()}")
    cfg.output = str(check_writable(output_path(cfg, argv), "output"))  # before the network is built
    out, shapes = export(cfg)
    print(f"exported {cfg.recipe_name} ({cfg.infer.format}, inputs {', '.join(map(str, shapes))}) to {out}")
    if task(cfg) == "translation":
        print(f"the file is the Transformer's teacher-forced forward at these lengths: source ids {shapes[0]} and "
              f"target ids so far {shapes[1]} (int32, 0-padded) -> logits, one row per target position; it does not "
              f"decode: README.md#export-and-run-the-file shows the loop that does", file=sys.stderr)


if __name__ == "__main__":
    run(main)
