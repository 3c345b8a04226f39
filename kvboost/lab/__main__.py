"""``python -m kvboost.lab [group=name ...] [key=value ...]``: the research runner (what ``run.py`` runs in a clone)."""

from kvboost.lab.run import cli

cli()
