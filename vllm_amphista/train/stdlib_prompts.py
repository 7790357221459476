"""`stdlib-prompts`: a code domain the heads never saw, built from the Python standard library on
this machine: "complete this function" prompts from documented functions, split by module into a
served half (traffic to record and adapt on) and a test half (never served before the comparison).

    python -m vllm_amphista.train stdlib-prompts --out-dir .cache/stdlib

Each prompt shows a function's signature and docstring; the target writes the body. Modules are
assigned to a half by a hash of their name, so no module (and no near-copy of a function) is in
both. The files are question files (`turns`, `category`), read by `generate`, the benchmark and
`vllm bench serve` alike. Nothing comes from Spec-Bench or MT-Bench.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sysconfig
from pathlib import Path

# Test suites, GUI toolkits and vendored packages are not the library's own documented code.
SKIPPED_PARTS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                 "__pycache__", "_vendor", "pydoc_data"}
PROMPT = "Complete this Python function from the standard library's `{module}` module:\n\n```python\n{stub}\n```"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", required=True, help="writes served.jsonl and test.jsonl there")
    parser.add_argument("--per-module", type=int, default=20, help="at most this many functions per module")
    parser.add_argument("--max-docstring-lines", type=int, default=12)


def module_files(stdlib: Path) -> list[tuple[str, Path]]:
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if SKIPPED_PARTS & set(relative.parts) or relative.name.startswith("_"):
            continue
        files.append((".".join(relative.with_suffix("").parts), path))
    return files


def function_stubs(source: str, max_docstring_lines: int) -> list[str]:
    """Signature + docstring of each public, documented function or method of a module's source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    stubs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        docstring = ast.get_docstring(node)
        if not docstring or len(docstring.splitlines()) > max_docstring_lines or not node.body[1:]:
            continue
        keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        header = f"{keyword} {node.name}({ast.unparse(node.args)}){returns}:"
        indented = "\n".join("    " + line if line else "" for line in docstring.splitlines())
        stubs.append(f'{header}\n    """\n{indented}\n    """')
    return stubs


def half_of(module: str) -> str:
    return "served" if hashlib.sha256(module.encode()).digest()[0] % 2 == 0 else "test"


def build(out_dir: str, per_module: int = 20, max_docstring_lines: int = 12) -> dict[str, int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    halves: dict[str, list[dict]] = {"served": [], "test": []}
    for module, path in module_files(stdlib):
        half = half_of(module)
        for stub in function_stubs(path.read_text(encoding="utf-8", errors="replace"), max_docstring_lines)[:per_module]:
            records = halves[half]
            records.append({"question_id": len(records), "category": f"stdlib-{half}", "module": module,
                            "turns": [PROMPT.format(module=module, stub=stub)]})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for half, records in halves.items():
        (out / f"{half}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return {half: len(records) for half, records in halves.items()}
