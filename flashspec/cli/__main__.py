"""``python -m flashspec.cli``: the ``flashspec`` command, as ``python -m flashspec``."""

import sys

from .command import main

sys.exit(main())
