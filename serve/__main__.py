"""`python -m serve`: the OpenAI-compatible server (serve/cli.py has the flags)."""
import sys

from serve.cli import main

sys.exit(main())
