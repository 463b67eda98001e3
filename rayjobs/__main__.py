"""``python -m rayjobs``: the same command line as the ``rayjobs`` script."""

import sys

from rayjobs.cli import main

sys.exit(main())
