"""`python -m autopar ...`: the same as the `autopar` command."""

import sys

from .cli import main

sys.exit(main())
