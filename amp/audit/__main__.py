"""`python -m amp.audit`: runs amp/audit/command.py (-h prints its usage)."""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

from amp.audit.command import main

if __name__ == "__main__":
    run(main)
