"""``python -m chunkloss.cli``: the ``chunkloss`` command."""

import sys

from . import main

sys.exit(main())
