"""amp-zoo's own package. Its modules here are the core every layer builds on: errors, the registry, the config
schema and its Hydra composition, the command line's options, the MindSpore set-up (runtime), and entry, every
command's start-up. data/ holds the readers and pipelines; engine/ turns a recipe into a run, and engine/process/
is what train.py does around it. Importing the package imports nothing of MindSpore's."""
