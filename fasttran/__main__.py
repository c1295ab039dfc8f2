"""`python -m fasttran ...` = the `fasttran` command (so `torchrun -m fasttran ...` works too)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
