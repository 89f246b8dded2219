"""The serve tier's fixtures, defined once for every module here: a session fixture imported into
two modules would be two fixtures (two Serve starts on two ports)."""

from serve_fixtures import ray_cluster as ray_cluster  # noqa: F401
from serve_fixtures import real_app as real_app  # noqa: F401
from serve_fixtures import serve_port as serve_port  # noqa: F401
from serve_fixtures import tiny_app as tiny_app  # noqa: F401
from serve_fixtures import tiny_model_dir as tiny_model_dir  # noqa: F401
