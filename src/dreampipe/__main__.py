"""``python -m dreampipe``: the same as the ``dreampipe`` command."""

import sys

from dreampipe.cli import main

__all__: list[str] = []

sys.exit(main())
