"""The AMP commands that build on the engine: `python -m amp.report | amp.audit | amp.search` run these."""
