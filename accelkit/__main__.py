"""``python -m accelkit``: the same as the ``accelkit`` command."""

from ._cli import main

raise SystemExit(main())
