"""`python -m ckgen`: the `ckgen` command line."""
import sys

from .cli import main

sys.exit(main())
