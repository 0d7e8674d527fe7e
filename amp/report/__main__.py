"""`python -m amp.report`: runs amp/report/command.py (-h prints its usage)."""
from ampzoo.entry import run  # first: a command's start-up, before MindSpore loads

from amp.report.command import main

if __name__ == "__main__":
    run(main)
