"""`python -m ckgen.cli`: the `ckgen` command line."""
import sys

from . import main

sys.exit(main())
