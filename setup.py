"""The one part of the build that pyproject.toml cannot say: the top-level ``configs/`` ships inside the package.

The shipped configs live in ``configs/`` at the top of the checkout, where a reader looks for them, and a wheel
installs them as ``diloco_peer/configs/*.toml``, so that ``--config tiny-cpu`` works from any install
(``config/loading.py`` finds them in either place). setuptools' ``package-data`` cannot reach outside a package,
and its ``packages.find`` cannot list a package mapped from another directory: both are said here instead.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["diloco_peer*"]), "diloco_peer.configs"],
    package_dir={"diloco_peer.configs": "configs"},
    package_data={"diloco_peer.configs": ["*.toml"]},
)
