"""The engine: what turns a recipe into a run. Loading and validating a config (load), the train step's loss
(metrics) and optimizer (optim), checkpoints and the inference network (checkpoint, fuse), the callbacks of a
run, its directory (rundir), shipped weights (weights), and a run in a process of its own (train_run). For
train.py: where a run starts (start), what it trains with (plan), what its rungs share (state), the files that
record it (records), and the process around it (process/: command line, run directory, error lines).

It sits above models/, ampzoo/data/ and amp/ and imports them; nothing below imports it."""
