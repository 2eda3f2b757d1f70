"""`python -m pacerl` is the `pacerl` command."""

import sys

from pacerl.cli import main

sys.exit(main())
