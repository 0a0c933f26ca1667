"""The installed package: one version number (CMake's project line), and
the extension's type stubs beside it (nanobind's stubgen at build time)."""

import ast
import pathlib
import re

import moeforge as mf

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = pathlib.Path(mf.__file__).parent


def test_the_version_is_cmakes():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    version = re.search(r"project\(moeforge VERSION ([0-9.]+)", cmake).group(1)
    assert mf.__version__ == version


def test_the_extension_has_type_stubs():
    stub = PACKAGE / "_core.pyi"
    assert stub.is_file() and (PACKAGE / "py.typed").is_file()
    tree = ast.parse(stub.read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert {"Pipeline", "Schedule", "TrainingLayer", "UserError"} <= classes
