"""Start the supervisor: ``python3 -I /.sandpiper/supervisor/__main__.py [--listen SOCKET]``.

Isolated mode (``-I``) puts no folder on ``sys.path`` (neither the script's nor the
current one, and ``PYTHONPATH`` is ignored), so nothing the agent writes can be imported
here. This file therefore loads its own folder as the package ``supervisor`` by path, and
nothing else becomes importable. Run as ``python -m sandpiper.collector.sandbox.supervisor``
it is already in its package.
"""

import importlib
import importlib.util
import os
import sys


def _server():
    if __package__:
        return importlib.import_module(f"{__package__}.server")
    folder = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "supervisor", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["supervisor"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("supervisor.server")


if __name__ == "__main__":
    _server().main()
