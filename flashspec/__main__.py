"""``python -m flashspec``: the ``flashspec`` command (see ``flashspec.cli``)."""

import sys

from .cli.command import main

sys.exit(main())
