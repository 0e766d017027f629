"""Every ```python example of docs/python.md runs, in order and in one namespace, against the
real server binary (`SERVER`), with a Spark session (`spark`) and a scratch directory
(`WORK`)."""

import re

from conftest import ROOT


def examples() -> list[str]:
    text = (ROOT / "docs" / "python.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_python_guide_runs(server, spark, tmp_path):
    blocks = examples()
    assert len(blocks) >= 6, "the guide's examples were not found"
    namespace = {"SERVER": server, "WORK": str(tmp_path), "spark": spark}
    for number, block in enumerate(blocks, start=1):
        try:
            exec(compile(block, f"docs/python.md example {number}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"docs/python.md example {number} failed: {error}") from error
