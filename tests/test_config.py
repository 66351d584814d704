"""Config: typed decoding, errors that name the key, overrides, the CLI's one-line errors."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import importlib.util

import pytest

from actors.config import Config, ConfigError, load_config, to_yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_shipped_config_loads_into_typed_structs():
    cfg = load_config(ROOT / "fully_async.yaml")
    assert isinstance(cfg, Config)
    assert isinstance(cfg.trainer.lr, float)
    assert cfg.policy.type == "fully_async"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.lrr=1", "trainer.lrr: unknown key (expected one of: backend"),
        ("trainer.lr=fast", "trainer.lr: expected float, got str"),
        ("trainer.lr=-1", "trainer.lr: expected float > 0.0"),
        ("rollout.n=2.5", "rollout.n: expected int, got float"),
        ("runtime.type=slurm", "runtime.type: invalid enum value 'slurm' (expected one of: local, process, ray)"),
        ("trainer.master_dtype=fp8", "trainer.master_dtype: invalid enum value 'fp8' (expected one of: float32, bfloat16, null)"),
        ("sync.mode=fast", "sync.mode: invalid enum value 'fast'"),
        ("nosuch.key=1", "nosuch: unknown key"),
        ("trainer=3", "trainer: expected object, got int"),
        ("rollout.engine.max_model_len=8", "rollout.max_response_tokens"),
        ("sync.transport=cuda_ipc", "sync.transport: 'cuda_ipc' needs one process per actor"),
        ("transfer_queue.ports=[0, 10]", "transfer_queue.ports.0: expected int >= 1"),
        ("transfer_queue.ports=30000", "transfer_queue.ports: expected array | null, got int"),
        ("transfer_queue.ports=[30000, 30010]", "transfer_queue.ports: expected [first, last] with first <= last, "
                                                "used with transfer_queue.deployment=ray; got [30000, 30010] with 'local'"),
    ],
)
def test_bad_values_name_the_path_and_expected_type(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(("override", "key", "extra"), [
    ("rollout.engine.type=vllm", "rollout.engine.type", "vllm"),
    ("rollout.engine.type=sglang", "rollout.engine.type", "sglang"),
    ("trainer.backend=megatron", "trainer.backend", "megatron"),
])
def test_an_engine_or_backend_this_build_lacks_is_refused_at_load(override, key, extra):
    if importlib.util.find_spec(extra) is not None:
        pytest.skip(f"{extra} is installed here")
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    why = f"{extra} is not installed; " if extra in ("vllm", "sglang") else f"this build has no {extra} "
    assert msg.startswith(f"{key}: '{extra}' is not available: {why}")
    assert f'pip install -e ".[{extra}]"' in msg


def test_cli_refuses_a_missing_engine_in_one_line_before_any_run_directory(tmp_path):
    out = tmp_path / "runs"
    res = _cli("fully_async.yaml", "rollout.engine.type=sglang", f"run.output_dir={out}")
    assert res.returncode == 2
    assert res.stderr.startswith("error: rollout.engine.type: 'sglang' is not available") and res.stderr.count("\n") == 1
    assert not out.exists()


def test_sections_live_with_their_components_and_keep_one_set_of_defaults():
    from actors.backends.config import TrainerConfig
    from actors.engines.config import EngineConfig
    from sync.config import SyncConfig
    from transfer_queue.config import TransferQueueConfig

    cfg = load_config(None)
    assert (type(cfg.rollout.engine), type(cfg.trainer), type(cfg.sync), type(cfg.transfer_queue)) == (
        EngineConfig, TrainerConfig, SyncConfig, TransferQueueConfig)
    assert cfg == Config() and cfg.transfer_queue == TransferQueueConfig()


def test_a_section_check_of_its_own_names_the_dotted_key():
    with pytest.raises(ConfigError, match=r"^transfer_queue\.ports: must be \(first, last\) with 1 <= first <= last"):
        load_config(None, ["transfer_queue.ports=[30010, 30000]", "transfer_queue.deployment=ray", "runtime.type=ray"])
    with pytest.raises(ConfigError, match=r"^transfer_queue\.ray_num_cpus: expected float >= 0"):
        load_config(None, ["transfer_queue.ray_num_cpus=-1"])


def test_cuda_ipc_transport_needs_the_trainer_and_engines_on_gpus():
    with pytest.raises(ConfigError, match="'cuda_ipc' needs the trainer and the engines on GPUs; got "
                                          "trainer.device='cpu', rollout.engine.device='cpu'"):
        load_config(None, ["sync.transport=cuda_ipc", "runtime.type=process"])
    cfg = load_config(None, ["sync.transport=cuda_ipc", "runtime.type=process", "trainer.device=cuda",
                             "rollout.engine.device=cuda:0"])
    assert cfg.sync.transport == "cuda_ipc"


def test_unknown_key_in_a_file_names_its_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lr: 1e-5\n  warmup: 3\n")
    with pytest.raises(ConfigError, match=r"^trainer\.warmup: unknown key"):
        load_config(bad)


def test_overrides_parse_scientific_floats_and_nested_keys():
    cfg = load_config(None, ["trainer.lr=2e-6", "runtime.type=ray", "rollout.engine.dtype=bfloat16",
                             "run.progress=false"])
    assert cfg.trainer.lr == 2e-6
    assert cfg.runtime.type == "ray"
    assert cfg.rollout.engine.dtype == "bfloat16"
    assert cfg.run.progress is False


def test_master_dtype_defaults_to_fp32_main_params_and_null_turns_them_off():
    assert load_config(None, ["trainer.dtype=bfloat16"]).trainer.master_dtype == "float32"
    assert load_config(None, ["trainer.master_dtype=null"]).trainer.master_dtype is None


def test_malformed_override_and_yaml_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(None, ["trainer.lr"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(ROOT / "fully_async.yaml", ["trainer.lr=3e-6"])
    path = tmp_path / "resolved.yaml"
    text = to_yaml(cfg).replace(f"base_dir: {cfg.base_dir}\n", "")
    path.write_text(text)
    again = load_config(path)
    assert again.trainer.lr == 3e-6 and again.rollout == cfg.rollout


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "actors.launch", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_help_explains_the_arguments():
    res = _cli("--help")
    assert res.returncode == 0
    assert "key.path=value" in res.stdout and "config" in res.stdout


def test_cli_missing_or_malformed_config_is_one_line(tmp_path):
    res = _cli(str(tmp_path / "nope.yaml"))
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "config file not found" in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {total_steps: x}\n")
    res = _cli(str(bad))
    assert res.returncode == 2
    assert res.stderr.strip() == "error: run.total_steps: expected int, got str ('x')"


def test_cli_missing_model_path_is_one_line():
    res = _cli("fully_async.yaml", "model.path=/nonexistent/model", "run.output_dir=/tmp/asyncrl-test-runs")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "/nonexistent/model" in res.stderr


@pytest.mark.parametrize(("trainer", "engine", "setting", "overlap"), [
    ("cpu", "cpu", "null", False), ("cuda", "cuda:0", "null", False), ("cuda:0", "cuda:1", "null", True),
    ("cuda:0", "cuda:0", "true", True), ("cuda:0", "cuda:1", "false", False),
])
def test_fully_async_overlaps_a_push_with_training_only_off_the_engines_device(trainer, engine, setting, overlap):
    from types import SimpleNamespace

    from policies.fully_async import FullyAsyncPolicy

    cfg = load_config(None, [f"trainer.device={trainer}", f"rollout.engine.device={engine}",
                             f"policy.overlap_push={setting}"])
    assert FullyAsyncPolicy.overlap_push.fget(SimpleNamespace(cfg=cfg)) is overlap


@pytest.mark.parametrize(("overrides", "message"), [
    (["sync.transport=inproc", "runtime.type=process"], "sync.transport: 'inproc' needs the trainer and the engines in one process"),
    (["sync.transport=ray", "runtime.type=process"], "sync.transport: 'ray' (Ray's object store) needs runtime.type=ray"),
])
def test_a_forced_transport_that_cannot_reach_the_engines_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_a_value_out_of_bounds_is_echoed_in_its_one_line():
    with pytest.raises(ConfigError, match=r"^trainer\.lr: expected float > 0\.0, got -1$"):
        load_config(ROOT / "fully_async.yaml", ["trainer.lr=-1"])
    with pytest.raises(ConfigError, match=r"^rollout\.n: expected int, got str \('abc'\)$"):
        load_config(ROOT / "fully_async.yaml", ["rollout.n=abc"])


def test_in_flight_modes_the_engine_or_colocated_cannot_do_are_one_line_at_load():
    assert load_config(ROOT / "fully_async.yaml").sync.in_flight_for("torch") == "keep"  # auto, not colocated
    assert load_config(ROOT / "fully_async.yaml", ["sync.colocated=true"]).sync.in_flight_for("torch") == "recompute"
    with pytest.raises(ConfigError, match=r"^sync\.in_flight: 'keep' needs the KV cache") as info:
        load_config(ROOT / "fully_async.yaml", ["sync.in_flight=keep", "sync.colocated=true"])
    assert "\n" not in str(info.value)


def test_trainer_checkpoint_every_is_renamed_and_old_saved_configs_still_resume(tmp_path):
    from actors.config import load_resume_config

    with pytest.raises(ConfigError, match=r"^trainer\.checkpoint_every: renamed run\.checkpoint_every"):
        load_config(ROOT / "fully_async.yaml", ["trainer.checkpoint_every=5"])
    saved = tmp_path / "config.yaml"  # a run saved before the rename wrote the old key
    text = to_yaml(load_config(ROOT / "fully_async.yaml"))
    assert "\ntrainer:\n" in text
    saved.write_text(text.replace("\ntrainer:\n", "\ntrainer:\n  checkpoint_every: 7\n", 1))
    assert load_resume_config(saved).run.checkpoint_every == 7
