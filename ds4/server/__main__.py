"""`python -m ds4.server`: serve the model over the OpenAI API (docs/server.md)."""
import sys

from ds4.server.app import main

sys.exit(main())
