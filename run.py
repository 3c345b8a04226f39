"""``python run.py [group=name ...] [key=value ...]``: kvboost's research runner from a clone (the same as
``kvboost-run`` or ``python -m kvboost.lab`` from an installed wheel). The runner is :mod:`kvboost.lab.run`; its
configs are the package's (``kvboost/configs``)."""

from kvboost.lab.run import cli

if __name__ == "__main__":
    cli()
