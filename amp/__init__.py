"""The AMP tools as commands: `python -m amp.report | amp.audit | amp.search` (report/, audit/, search/, a
command.py each). They drive the engine; the AMP library they report on is ampzoo.amp."""
