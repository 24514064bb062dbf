"""`python -m attnres_pp ...` is the `attnres-pp` command: what `torchrun -m attnres_pp train
--launcher torchrun ...` runs in each process it starts."""

import sys

from attnres_pp.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
