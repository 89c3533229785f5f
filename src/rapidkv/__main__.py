"""`python -m rapidkv`: the same as the `rapidkv` command."""

import sys

from rapidkv.cli import main

sys.exit(main())
