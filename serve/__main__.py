"""`python -m serve`: the OpenAI-compatible server (serve/cli.py has the flags)."""
import sys

from serve.cli import main

if __name__ == "__main__":      # worker ranks (spawn) re-import this module: they must not serve
    sys.exit(main())
