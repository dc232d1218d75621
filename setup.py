"""Package discovery: the checkout's top-level folders install as ``dualserve.<folder>``.

``pyproject.toml`` holds the metadata; this file only finds the packages, so a new package folder
(any folder with an ``__init__.py``) is in the wheel without a list to keep up to date.
"""

from setuptools import find_packages, setup

ROOTS = ("server", "decoders", "models", "clients")


def discover() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for root in ROOTS:
        package_dir[f"dualserve.{root}"] = root
        packages.append(f"dualserve.{root}")
        packages += [f"dualserve.{root}.{sub}" for sub in find_packages(root)]
    return packages, package_dir


PACKAGES, PACKAGE_DIR = discover()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR)
