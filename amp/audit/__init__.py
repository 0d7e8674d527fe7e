"""`python -m amp.audit`, the fp16 audit: which Cells are unsafe in low precision.

The command (command.py) builds on the engine, which builds on the amp library: nothing in the library
imports it."""
