import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The serve tier's session fixtures, registered once here: a session fixture imported into two test
# modules would be two fixtures (two Serve starts on two ports).
from serve_fixtures import ray_cluster, real_app, serve_port, tiny_app, tiny_model_dir  # noqa: E402, F401
