"""`python -m attnres_lab`: the `attnres-lab` command."""

import sys

from attnres_lab.cli import console_main

sys.exit(console_main())
