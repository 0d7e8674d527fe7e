"""The process around a run: what a command does before and after its work, each in a module of its own.

- command: train.py's command line, read once before Hydra composes it, and a sweep that goes on past a failed job
- directory: the run directory as one object, opened, claimed and closed, that removes only what it created
- failures: the one line for what model.train raised (data, device, a model that does not compile)
- logs: what goes into train.log alone, and the quieter console of msrun's other ranks

The stop signals (ampzoo.interrupt.handled) and the one line an error ends in (ampzoo.report.report) sit in the
core, for every command; this layer sits on top of the engine, and only train.py imports it."""
