"""`python -m specwire` runs the CLI."""

import sys

from specwire.cli import main

sys.exit(main())
