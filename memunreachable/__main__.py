"""__main__.py: `python -m memunreachable ...` runs the command line (cli.main)."""
import sys

from memunreachable.cli import main

if __name__ == "__main__":
    sys.exit(main())
