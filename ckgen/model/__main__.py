"""`python -m ckgen.model fit`: see ckgen/model/command.py."""
from .command import main

raise SystemExit(main())
