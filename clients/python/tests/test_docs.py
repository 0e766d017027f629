"""Every ```python example of docs/python.md runs, in order and in one namespace, against the
real server binary (`SERVER`), with a Spark session (`spark`) and a scratch directory
(`WORK`); so do those of docs/sql.md, with `SERVER` alone."""

import re

from conftest import ROOT


def examples(guide: str = "python.md") -> list[str]:
    text = (ROOT / "docs" / guide).read_text()
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


def test_the_sql_guide_runs(server):
    """docs/sql.md's ADBC, DuckDB and SQLAlchemy examples, against the same server."""
    blocks = examples("sql.md")
    assert len(blocks) >= 4, "the guide's examples were not found"
    namespace = {"SERVER": server}
    for number, block in enumerate(blocks, start=1):
        try:
            exec(compile(block, f"docs/sql.md example {number}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"docs/sql.md example {number} failed: {error}") from error
