"""The studies' tests run as the suite's do: Ray without its auth token, tokenizers single-threaded."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
