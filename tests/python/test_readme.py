"""README.md's Python runs as written (as tests/readme_snippets_gen.cpp does
for its C++)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python():
    assert python_blocks(), "README.md lost its Python example"


def test_the_readme_python_runs(capsys):
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), {})
