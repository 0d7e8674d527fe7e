"""`python -m amp.search`, the precision-policy search: the most low precision within a tolerance of O0.

The command (command.py) builds on the engine, which builds on the amp library: nothing in the library
imports it."""
