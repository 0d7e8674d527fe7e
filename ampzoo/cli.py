"""Options beside the Hydra overrides on a command line (`--rounds 30`), each bad one a single error line."""
from typing import Callable, List, Tuple

from ampzoo.errors import fail


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


def pop_all(argv: List[str], name: str, convert: Callable = str) -> Tuple[list, List[str]]:
    """Every `--name VALUE` of a repeatable option (`--only A --only B`), taken out of argv in order."""
    values = []
    while name in argv:
        value, argv = pop_option(argv, name, None, convert)
        values.append(value)
    return values, argv


def pop_flag(argv: List[str], name: str) -> Tuple[bool, List[str]]:
    """Whether the bare `--name` was given, and argv without it."""
    return name in argv, [a for a in argv if a != name]

