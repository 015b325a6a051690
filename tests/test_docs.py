"""The guide builds: ``mkdocs build --strict`` fails on a broken link, anchor or API reference."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_every_public_strategy_has_a_page_in_the_guide() -> None:
    tree = ast.parse((ROOT / "loom" / "__init__.py").read_text())
    names = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__")
    strategies = {n for n in names if n.endswith("Strategy") and n != "Strategy"}
    pages = "".join(p.read_text() for p in (ROOT / "docs" / "strategies").glob("*.md"))
    missing = sorted(n for n in strategies if f"# {n}" not in pages and f"`{n}`" not in pages)
    assert not missing, f"strategies with no page under docs/strategies/: {missing}"
