"""`python -m amp.report`, the precision report: every Cell's compute dtype, and why.

The command (command.py) builds on the engine, which builds on the amp library: nothing in the library
imports it."""
