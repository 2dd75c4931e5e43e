"""``python -m flashspec``: the ``flashspec`` command (see ``flashspec.cli``)."""

import sys

from .cli import main

sys.exit(main())
