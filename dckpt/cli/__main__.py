"""``python -m dckpt.cli``: the same as the ``dckpt`` command."""

import sys

from . import main

sys.exit(main())
