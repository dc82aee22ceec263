"""raysparse.kernels"""

if __name__ == "kernels":
    # This folder is the package raysparse.kernels (pyproject's package-dir). With the repository root on sys.path
    # (``python -m`` run from it, and the Ray workers of a driver started there, which put its directory first) it
    # would also import as a top-level ``kernels`` and shadow the PyPI package of that name, which transformers
    # imports where it is installed: that name goes to the installed package.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:  # (none installed: this folder answers, as it always did)
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
