"""``python -m kvboost.serving``: the ``kvboost-server`` command (see :mod:`kvboost.serving.cli`)."""

import sys

from kvboost.serving.cli import main

sys.exit(main())
