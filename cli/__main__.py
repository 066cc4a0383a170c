"""`python -m tierstack.cli ...`: the `tierstack` command."""

import sys

from tierstack.cli import main

if __name__ == "__main__":
    sys.exit(main())
