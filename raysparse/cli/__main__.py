"""``python -m raysparse.cli``: the ``raysparse`` command, for an environment without the console script."""

import sys

from raysparse.cli import main

sys.exit(main())
