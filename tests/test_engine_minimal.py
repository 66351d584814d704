"""The engine contract run against the minimal engine of ``docs/engines.md``
("Adding an engine"): examples/minimal_engine.py, registered in one line and built
by ``make_engine`` as a run builds it; and that page shows that same file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.config import ConfigError, load_config
from actors.engines import ENGINES, EngineConfig, make_engine, register_engine
from actors.launch import launch
from tests.engine_contract import EngineContract

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FILE = ROOT / "examples" / "minimal_engine.py"
IMPORT_PATH = "examples.minimal_engine:MinimalEngine"

register_engine("minimal", "examples.minimal_engine:MinimalEngine")


@pytest.fixture
def engine_factory():
    return lambda model_dir, **options: make_engine(EngineConfig(type="minimal", **options), model_dir, seed=0)


class TestMinimalEngineContract(EngineContract):
    pass


@pytest.mark.parametrize("runtime", ["local", pytest.param("process", marks=pytest.mark.slow)])
def test_a_run_trains_with_the_engine_its_config_names_by_import_path(runtime, tmp_path):
    # under the process runtime each rollout actor imports the engine from the config it is sent
    run = launch(ROOT / "fully_async.yaml", f"rollout.engine.type={IMPORT_PATH}", f"runtime.type={runtime}",
                 "run.total_steps=2", "trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8",
                 "run.progress=false", f"run.output_dir={tmp_path}")
    try:
        run.train(steps=2)
        run.check()
        assert [m["sync/kind"] for m in run.history] == ["full", "delta"]
    finally:
        run.close()
    assert f"type: {IMPORT_PATH}" in (run.dir / "config.yaml").read_text()


def test_the_docs_show_the_minimal_engine_file_and_this_test_as_they_are():
    page = (ROOT / "docs" / "engines.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert ENGINE_FILE.read_text() in blocks
    (test_lines,) = [b for b in blocks if b.startswith('register_engine("minimal"')]
    assert test_lines in Path(__file__).read_text()  # and the lines of this test it quotes


def test_a_config_names_an_engine_by_its_import_path_or_registered_name(tiny_models):
    path, _ = tiny_models["qwen2"]
    for engine_type in (IMPORT_PATH, "minimal"):
        cfg = load_config(None, [f"rollout.engine.type={engine_type}"])
        assert type(make_engine(cfg.rollout.engine, path, seed=0)).__name__ == "MinimalEngine"


@pytest.mark.parametrize(("engine_type", "message"), [
    ("tgi", r"'tgi' is unknown \(expected one of: torch, vllm, sglang, .*minimal.*; or an import path "
            r"'package\.module:attr'\)$"),
    ("examples.nowhere:Engine", r"'examples\.nowhere:Engine': cannot import module 'examples\.nowhere': "
                                r"ModuleNotFoundError"),
    ("examples.minimal_engine:Missing", r"'examples\.minimal_engine:Missing': module 'examples\.minimal_engine' "
                                        r"has no attribute 'Missing'$"),
])
def test_an_engine_type_that_names_nothing_is_refused_at_load_in_one_line(engine_type, message):
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.type: " + message) as err:
        load_config(None, [f"rollout.engine.type={engine_type}"])
    assert "\n" not in str(err.value)


def test_a_name_is_registered_once():
    register_engine("minimal", IMPORT_PATH)  # again, the same: nothing changes
    with pytest.raises(ValueError, match=r"^rollout\.engine\.type: 'minimal' is registered already"):
        register_engine("minimal", "examples.other:Engine")
    with pytest.raises(ValueError, match="no ':'"):
        register_engine("my:engine", IMPORT_PATH)
    assert ENGINES.names()[:3] == ("torch", "vllm", "sglang")
