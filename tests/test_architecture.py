"""The import graph keeps its rules (scripts/architecture.py): no circle between modules or packages, no import up
the layers, no Megatron/vLLM in algorithms/, no private name taken from another module, no module over 400 lines,
no product function over 60 lines but the listed ones (a list that only shrinks), no import of a project module
inside a function but the listed ones (a list that only shrinks, under a total); docs/architecture.md shows the
arrows of the code as it is. Planted trees show that each check fails."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts" / "architecture.py")
architecture = importlib.util.module_from_spec(_spec)
sys.modules["architecture"] = architecture  # dataclasses look their module up by name
_spec.loader.exec_module(architecture)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_tree_keeps_the_rules():
    problems = architecture.analyse().problems()
    assert problems == [], "\n".join(problems)


def test_docs_show_the_arrows_of_the_code():
    text = architecture.DOC.read_text(encoding="utf-8")
    assert architecture.BEGIN in text and architecture.END in text
    assert architecture.doc_with(text, architecture.analyse()) == text, \
        "docs/architecture.md is stale: run python scripts/architecture.py --write-docs"


def test_every_package_has_a_layer():
    for module in architecture.load_modules(ROOT):
        architecture.layer_of(architecture.package_of(module))  # KeyError names the package


def test_planted_tree_fails_on_each_rule(tmp_path):
    """A synthetic tree with one breach of each rule: each is reported, exactly, and nothing else."""
    root = _tree(tmp_path, {
        "megatron_dynamo/__init__.py": "",
        "megatron_dynamo/trainer/__init__.py": "",
        "megatron_dynamo/trainer/loop.py": """
            def run():
                from ..eval import scorer  # inside a function, relative: still an arrow trainer -> eval
                return scorer.score()
            """,
        "megatron_dynamo/eval/__init__.py": "",
        "megatron_dynamo/eval/scorer.py": """
            from megatron_dynamo.trainer.loop import run  # eval -> trainer: up the layers, and a circle

            def score():
                return 1
            """,
        "megatron_dynamo/data/__init__.py": "",
        "megatron_dynamo/data/rows.py": """
            class Reader:
                def _parse(self):
                    return 0

            def _validate(row):
                return row
            """,
        "megatron_dynamo/data/hub.py": """
            from megatron_dynamo.data.rows import Reader, _validate
            from megatron_dynamo.data import rows

            def fetch():
                return Reader()._parse(), _validate(1), rows._validate(2), Reader._parse
            """,
        "megatron_dynamo/algorithms/__init__.py": "",
        "megatron_dynamo/algorithms/loss.py": "import torch\nfrom megatron.core import parallel_state\n",
        "megatron_dynamo/models/__init__.py": "",
        "megatron_dynamo/models/big.py": "x = 1\n" * 41,
        "checkpoints_convert/__init__.py": "",
        "checkpoints_convert/convert.py": """
            from megatron_dynamo.models import big  # allowed: the converter shares models/ with the trainer
            from megatron_dynamo.trainer.loop import run  # an entry point may call down, but the converter not here
            """,
    })
    report = architecture.analyse(root, ("megatron_dynamo", "checkpoints_convert"), max_lines=40, long_functions={},
                                  max_function_imports=1,
                                  allowed_function_imports={"megatron_dynamo/trainer/loop.py": 1})
    assert report.module_cycles == [["megatron_dynamo.eval.scorer", "megatron_dynamo.trainer.loop"]]
    assert report.package_cycles == [["eval", "trainer"]]
    assert report.upward == ["megatron_dynamo/eval/scorer.py:2: megatron_dynamo.eval.scorer (stages) imports "
                             "megatron_dynamo.trainer.loop (trainer): up the layers"]
    assert sorted(report.forbidden) == [
        "checkpoints_convert/convert.py:3: checkpoints_convert.convert imports megatron_dynamo.trainer.loop "
        "(checkpoints_convert/ imports only models, parallel, data, __init__, config, cpus, heap, library_logs)",
        "megatron_dynamo/algorithms/loss.py:2: megatron_dynamo.algorithms.loss imports "
        "megatron.core (algorithms/ imports no megatron, vllm)"]
    assert sorted(report.private) == sorted([
        "megatron_dynamo/data/hub.py:2: megatron_dynamo.data.hub imports the private name _validate from "
        "megatron_dynamo.data.rows",
        "megatron_dynamo/data/hub.py:6: megatron_dynamo.data.hub uses the private name _parse of "
        "megatron_dynamo.data.rows",
        "megatron_dynamo/data/hub.py:6: megatron_dynamo.data.hub uses the private name "
        "megatron_dynamo.data.rows._validate",
        "megatron_dynamo/data/hub.py:6: megatron_dynamo.data.hub uses the private name "
        "megatron_dynamo.data.rows.Reader._parse",
    ])
    assert report.too_long == ["megatron_dynamo/models/big.py: 41 lines (over 40)"]
    assert report.long_functions == []
    assert len(report.problems()) == 2 + 1 + 2 + 4 + 1


def test_the_update_stage_keeps_its_functions_short():
    """The update and the step that calls it hold no function over the budget, and none is allowed there."""
    lengths = architecture.function_lengths(architecture.load_modules(ROOT))
    mine = {name: n for name, n in lengths.items()
            if name.split(":")[0] in ("megatron_dynamo/trainer/update.py", "megatron_dynamo/trainer/step.py")}
    assert "megatron_dynamo/trainer/update.py:PolicyUpdater.update" in mine
    assert max(mine.values()) <= architecture.MAX_FUNCTION_LINES, mine
    assert not any(name in architecture.LONG_FUNCTIONS for name in mine)


def test_planted_long_functions_fail(tmp_path):
    """A function over the budget, one listed that grew, one listed that shrank below the budget, a listed one that
    is gone: each is reported; a listed one at its length, a long benchmark and a long class body are not."""
    def function(name: str, lines: int, indent: str = "") -> str:
        return f"{indent}def {name}():\n" + f"{indent}    x = 1\n" * (lines - 2) + f"{indent}    return x\n"

    root = _tree(tmp_path, {
        "megatron_dynamo/__init__.py": "",
        "megatron_dynamo/data/__init__.py": "",
        "megatron_dynamo/data/long.py": (function("new", 11) + function("grew", 13) + function("shrank", 9)
                                         + function("kept", 12) + "class Holder:\n" + function("method", 11, "    ")
                                         + "    y = 2\n" * 20),
        "benchmarks/__init__.py": "",
        "benchmarks/bench_x.py": function("main", 30),
    })
    allowed = {"megatron_dynamo/data/long.py:grew": 12, "megatron_dynamo/data/long.py:shrank": 12,
               "megatron_dynamo/data/long.py:kept": 12, "megatron_dynamo/data/long.py:gone": 20}
    report = architecture.analyse(root, ("megatron_dynamo", "benchmarks"), max_function_lines=10,
                                  long_functions=allowed, max_function_imports=0, allowed_function_imports={})
    assert report.long_functions == [
        "megatron_dynamo/data/long.py:Holder.method: function of 11 lines (over 10)",
        "megatron_dynamo/data/long.py:grew: function of 13 lines (listed at 12)",
        "megatron_dynamo/data/long.py:new: function of 11 lines (over 10)",
        "megatron_dynamo/data/long.py:gone: in LONG_FUNCTIONS (20) but gone: remove the entry",
        "megatron_dynamo/data/long.py:shrank: in LONG_FUNCTIONS (12) but 9 lines now: remove the entry",
    ]
    assert report.problems() == report.long_functions


def test_planted_function_imports_fail(tmp_path):
    """Imports of project modules inside functions: one in an unlisted module, one more than listed, an entry above
    its module's count, an entry whose module has none left, and a total over the maximum are each reported; module
    level imports, third-party imports inside functions and a listed module at its count are not."""
    root = _tree(tmp_path, {
        "megatron_dynamo/__init__.py": "",
        "megatron_dynamo/data/__init__.py": "",
        "megatron_dynamo/data/rows.py": "import json\nimport megatron_dynamo.data  # at module level: not counted\n",
        "megatron_dynamo/data/hub.py": """
            def fetch():
                import json
                from . import rows  # relative: still a project module
                return rows, json
            """,
        "megatron_dynamo/data/kept.py": """
            def one():
                if True:
                    import megatron_dynamo.data.rows
            """,
        "megatron_dynamo/data/grew.py": """
            class Holder:
                def method(self):
                    from megatron_dynamo.data.rows import hub
                    from megatron_dynamo.data import kept
            """,
        "megatron_dynamo/data/shrank.py": "def f():\n    from megatron_dynamo.data import rows\n",
        "benchmarks/__init__.py": "",
        "benchmarks/bench_x.py": "def main():\n    from megatron_dynamo.data import rows\n",
    })
    allowed = {"megatron_dynamo/data/kept.py": 1, "megatron_dynamo/data/grew.py": 1,
               "megatron_dynamo/data/shrank.py": 2, "megatron_dynamo/data/rows.py": 1}
    report = architecture.analyse(root, ("megatron_dynamo", "benchmarks"), long_functions={}, max_function_imports=4,
                                  allowed_function_imports=allowed)
    assert report.function_imports == [
        "megatron_dynamo/data/grew.py: 2 imports of project modules inside functions (listed at 1), at lines 4, 5: "
        "import at the top, or list it with its reason",
        "megatron_dynamo/data/hub.py: 1 imports of project modules inside functions (not listed), at lines 4: "
        "import at the top, or list it with its reason",
        "megatron_dynamo/data/rows.py: in FUNCTION_IMPORTS (1) but 0 now: lower the entry",
        "megatron_dynamo/data/shrank.py: in FUNCTION_IMPORTS (2) but 1 now: lower the entry",
        "5 imports of project modules inside functions, over MAX_FUNCTION_IMPORTS (4)",
    ]
    assert report.problems() == report.function_imports
    within = {"megatron_dynamo/data/kept.py": 1, "megatron_dynamo/data/grew.py": 2, "megatron_dynamo/data/shrank.py": 1,
              "megatron_dynamo/data/hub.py": 1}
    assert architecture.analyse(root, ("megatron_dynamo", "benchmarks"), long_functions={}, max_function_imports=5,
                                allowed_function_imports=within).problems() == []


def test_the_function_import_budget_adds_up():
    """The listed places are all the total allows: the maximum is no looser than the list."""
    assert sum(architecture.FUNCTION_IMPORTS.values()) <= architecture.MAX_FUNCTION_IMPORTS
    assert all(count > 0 for count in architecture.FUNCTION_IMPORTS.values())


def test_a_circle_planted_in_a_copy_of_the_tree_fails(tmp_path):
    """The real tree with one import added inside a function of models/: a package circle and an upward arrow."""
    shutil.copytree(ROOT / "megatron_dynamo", tmp_path / "megatron_dynamo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = architecture.analyse(tmp_path, ("megatron_dynamo",)).problems()
    qwen = tmp_path / "megatron_dynamo" / "models" / "qwen.py"
    qwen.write_text(qwen.read_text() + "\n\ndef _planted():\n    from megatron_dynamo.trainer import step\n"
                    "    return step\n")
    lines = len(qwen.read_text().splitlines()) - 1
    after = architecture.analyse(tmp_path, ("megatron_dynamo",))
    new = [p for p in after.problems() if p not in before]
    assert f"megatron_dynamo/models/qwen.py:{lines}: megatron_dynamo.models.qwen (foundations) imports " \
           "megatron_dynamo.trainer.step (trainer): up the layers" in new
    assert any(p.startswith("circle between packages:") and "models" in p and "trainer" in p for p in new), new


def test_write_and_check_docs(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "architecture.md"
    doc.write_text(f"# title\n\n{architecture.BEGIN}\nold\n{architecture.END}\ntail\n")
    monkeypatch.setattr(architecture, "DOC", doc)
    monkeypatch.setattr(architecture, "ROOT", tmp_path)  # DOC is shown relative to ROOT
    monkeypatch.setattr(architecture, "analyse", lambda: architecture.Report({}, []))
    assert architecture.main(["--check-docs"]) == 1
    assert architecture.main(["--write-docs"]) == 0
    assert architecture.main(["--check-docs"]) == 0
    text = doc.read_text()
    assert text.startswith("# title\n\n" + architecture.BEGIN) and text.endswith(architecture.END + "\ntail\n")
    assert "```mermaid" in text and "old" not in text
    doc.write_text("# no markers\n")
    assert architecture.main(["--write-docs"]) == 2
    assert "no generated markers" in capsys.readouterr().err


@pytest.mark.parametrize("module,package", [("megatron_dynamo.trainer.step", "trainer"),
                                            ("megatron_dynamo.config", "config"), ("megatron_dynamo", "__init__"),
                                            ("checkpoints_convert.cli", "checkpoints_convert"),
                                            ("benchmarks.bench_update", "benchmarks")])
def test_package_of(module, package):
    assert architecture.package_of(module) == package
