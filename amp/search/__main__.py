"""`python -m amp.search`, as docs/amp.md documents it, runs the command tools/amp_search.py: commands import the
engine, which imports this library, so they live with the other commands and this name only starts one."""
import runpy

runpy.run_module("tools.amp_search", run_name="__main__", alter_sys=True)
