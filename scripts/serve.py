"""Serve DeepSeek V4 Flash over an OpenAI-compatible HTTP API (default: the embedded tiny model). See docs/server.md."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4.server.app import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
