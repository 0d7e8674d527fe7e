"""Options beside the Hydra overrides on a command line (`--rounds 30`), each bad one a single error line."""
from typing import Callable, List, Tuple

from zoo.errors import fail


def pop_option(argv: List[str], name: str, default, convert: Callable = int) -> Tuple[object, List[str]]:
    """`--name VALUE` taken out of argv (the rest are Hydra overrides); a missing or bad value is one error line."""
    if name not in argv:
        return default, argv
    i = argv.index(name)
    try:
        return convert(argv[i + 1]), argv[:i] + argv[i + 2:]
    except (IndexError, ValueError):
        like = f" like {default!r}" if default is not None else ""
        fail(f"{name} needs a value{like}; got {argv[i + 1] if i + 1 < len(argv) else 'nothing'}")
