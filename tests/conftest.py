import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The serve tier's session fixtures, registered once here: a session fixture imported into two test
# modules would be two fixtures (two Serve starts on two ports).
from serve_fixtures import ray_cluster, real_app, serve_port, tiny_app, tiny_model_dir  # noqa: E402, F401


def pytest_collection_modifyitems(session, config, items):
    """The local multi-node cluster's tests (marker ``cluster``) run first: their module starts a
    Ray cluster of its own in this process, which must not meet the session's one-node Ray. The
    last test that uses the session's Ray is marked: it is ended after it (``pytest_runtest_teardown``)."""
    items.sort(key=lambda item: item.get_closest_marker("cluster") is None)
    users = [item for item in items if "ray_cluster" in getattr(item, "fixturenames", ())]
    if users:
        users[-1].last_ray_user = True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test using the session's Ray (and its module's fixtures' teardown), end it."""
    if getattr(item, "last_ray_user", False):
        from serve_fixtures import end_ray

        end_ray()
