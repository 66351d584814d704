"""The notebook API of a run: ``train`` and ``train_async`` stopped at a step
boundary by an interrupt or a cancel (and training again at once), their one-line
result, a train call past ``run.total_steps`` raising it visibly, the repr, the
metrics table (the same columns with and without pandas), the plot, and
``notebooks/quickstart.ipynb`` executed in a real Jupyter kernel with two kernel
interrupts mid-training, within its budget and small."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import signal
import sys
import threading
import time
import types

import pytest
import yaml

import loop
from actors import notebook
from actors.launch import launch
from tests.extras import needs

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the smallest run that takes the real path: built-in engine, torch trainer, queue, delta pushes
SMALL = ["trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false",
         "run.total_steps=100000"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    loop.shutdown()  # a fresh loop, in this thread (earlier tests may have moved it to a background thread)
    r = launch(ROOT / "fully_async.yaml", *SMALL, f"run.output_dir={tmp_path_factory.mktemp('runs')}")
    yield r
    r.close()


def _check_between_calls(run) -> dict:
    """What every stop must leave: records of whole steps only, each written once,
    the accounting identity, no engine paused, no task but the parked feeder."""
    state = run.check()
    assert state["produced"] == state["trained"] + state["dropped"] + state["pending"]
    assert state["tasks"] == ["feeder"]
    steps = [m["step"] for m in run.history]
    assert steps == list(range(1, state["step"] + 1))
    assert state["trained"] == run.history[-1]["trained"]
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == steps
    return state


@pytest.mark.timeout(120)
def test_a_keyboard_interrupt_stops_train_at_the_step_boundary_and_the_same_run_trains_again(run, default_sigint):
    """SIGINT to this process while ``train`` blocks (the loop in this thread, then
    from a thread that runs a foreign loop, as a notebook cell does)."""

    def interrupt_soon() -> None:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()

    for where in ("this thread", "foreign loop"):
        before = len(run.history)
        interrupt_soon()
        with pytest.raises(KeyboardInterrupt, match="training stopped after step"):
            if where == "this thread":
                assert not [t for t in threading.enumerate() if t.name == "asyncrl-loop"]
                run.train()  # the rest of run.total_steps
            else:
                async def cell() -> None:
                    run.train()

                foreign = asyncio.new_event_loop()  # with no SIGINT handler of its own, as Jupyter's
                try:
                    foreign.run_until_complete(cell())
                finally:
                    foreign.close()
        n = len(run.history)
        assert n > before
        time.sleep(0.2)
        assert len(run.history) == n, f"training went on after the interrupt ({where})"
        _check_between_calls(run)
        run.train(3)
        assert len(run.history) == n + 3
        _check_between_calls(run)


@pytest.mark.timeout(240)
def test_cancelling_train_async_at_random_points_20_times_leaves_a_run_that_trains_again(run):
    rng = random.Random(0)

    async def cancel_at_random(delay_s: float) -> None:
        task = asyncio.ensure_future(run.train_async())
        await asyncio.sleep(delay_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run.train(2)
    for i in range(20):
        before = len(run.history)
        delay_s = rng.choice([0.0, rng.uniform(0, 0.05), rng.uniform(0.05, 0.4)])  # before it starts, mid-step, later
        if i % 2:  # from a loop of the caller's own (a notebook's): the steps run on the run's background loop
            asyncio.run(cancel_at_random(delay_s))
        else:  # on the run's own loop
            loop.run(cancel_at_random(delay_s))
        n = len(run.history)
        time.sleep(0.05)
        assert len(run.history) == n, "training went on after the cancel"
        _check_between_calls(run)
        assert run.train(3) == run.history[-3:] and len(run.history) == n + 3, (i, before, n)
        _check_between_calls(run)


def test_train_async_from_the_run_loop_and_one_train_call_at_a_time(run):
    async def twice() -> list:
        first = asyncio.ensure_future(run.train_async(2))
        await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="training already"):
            await run.train_async(1)
        with pytest.raises(RuntimeError, match="train_async"):
            run.train(1)
        return await first

    records = loop.run(twice())
    assert [m["step"] for m in records] == [m["step"] for m in run.history[-2:]]
    _check_between_calls(run)


def test_repr_metrics_and_plot(run, monkeypatch):
    if not run.history:
        run.train(2)
    m = run.history[-1]
    text = repr(run)
    assert text.startswith("Run(fully_async, step ") and f"step {m['step']}/" in text
    assert f"reward {m['reward']:.3f}" in text and "staleness" in text and "samples/s" in text
    assert text.endswith(f", {run.dir})")  # where its files are

    monkeypatch.setitem(sys.modules, "pandas", None)  # not installed: a list of dicts, one a step
    table = run.metrics()
    assert [row["step"] for row in table] == [m["step"] for m in run.history] and table[0] is not run.history[0]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"asyncrl\[plot\]"):
        run.plot()


def test_train_returns_one_line_with_the_steps_it_took_and_keeps_the_records(run):
    result = run.train(3)
    first, last = result[0]["step"], result[-1]["step"]
    assert result == run.history[-3:] and last - first == 2  # still the records, a list
    text = repr(result)
    assert len(text) < 300 and "\n" not in text, text
    assert text.startswith(f"TrainResult(3 steps ({first}-{last} of {run.cfg.run.total_steps}), "
                           f"reward {result[-1]['reward']:.3f}, "), text
    assert "samples/s" in text and text.endswith(" s)") and result.wall_s > 0
    pretty = needs("IPython.lib.pretty", "dev").pretty
    assert pretty(result) == text  # what a notebook cell ending in run.train(3) shows
    again = loop.run(run.train_async(1))
    assert repr(again).startswith(f"TrainResult(1 step ({last + 1}-{last + 1} of ") and again == run.history[-1:]


def test_train_past_total_steps_raises_the_budget_with_a_one_line_notice(run, capsys):
    if not run.history:
        run.train(1)
    budget, step = run.cfg.run.total_steps, run.policy.step
    run.cfg.run.total_steps = step + 2  # two steps left
    try:
        capsys.readouterr()
        run.train(1)  # within the budget: no notice
        assert capsys.readouterr().err == "" and run.cfg.run.total_steps == step + 2
        result = run.train(3)  # one step left, three asked for
        assert capsys.readouterr().err == f"run.total_steps: {step + 2} -> {step + 4} (train(3) from step {step + 1})\n"
        assert run.cfg.run.total_steps == step + 4 and f"of {step + 4})" in repr(result)
        assert f"step {step + 4}/{step + 4}," in repr(run)
        assert len(run.train()) == 0 and capsys.readouterr().err == ""  # the rest: none, and no notice
        loop.run(run.train_async(2))
        assert capsys.readouterr().err == f"run.total_steps: {step + 4} -> {step + 6} (train(2) from step {step + 4})\n"
        assert f"step {step + 6}/{step + 6}," in repr(run)
    finally:
        run.cfg.run.total_steps = budget


def test_metrics_table_has_the_same_columns_with_and_without_pandas(monkeypatch):
    history = [{"step": 1, "reward": 0.5, "dropped": {}},
               {"step": 2, "reward": 0.7, "dropped": {"stale": 2}, "eval/reward": 0.4}]
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "pandas", None)  # not installed
        rows = notebook.metrics_table(history)
    assert rows == [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.7, "dropped/stale": 2, "eval/reward": 0.4}]
    pd = needs("pandas", "notebook")
    table = notebook.metrics_table(history)
    assert isinstance(table, pd.DataFrame)
    assert list(table.columns) == ["step", "reward", "dropped/stale", "eval/reward"]  # every row's keys, in order
    assert list(table["step"]) == [1, 2] and table.loc[1, "reward"] == 0.7 and table.loc[1, "dropped/stale"] == 2
    assert table.to_dict("records")[1] == rows[1]


def test_plot_draws_reward_eval_staleness_and_throughput_with_matplotlib():
    matplotlib = needs("matplotlib", "plot")
    matplotlib.use("Agg")
    history = [{"step": s, "reward": 0.1 * s, "staleness_mean": 0.5, "staleness_max": 1, "samples_per_s": 90.0,
                "train/loss": 1.0 / s, **({"eval/reward": 0.3} if s == 2 else {})} for s in (1, 2, 3)]
    axes = notebook.plot(history, {"step": 0, "eval/reward": 0.2})
    labels = [[line.get_label() for line in ax.get_lines()] for ax in axes]
    assert labels == [["train reward", "eval reward"], ["mean", "max"], ["samples/s"]]
    assert list(axes[0].get_lines()[1].get_xdata()) == [0, 2]  # the eval before step 1, then step 2's
    assert len(axes[0].figure.axes) == 3
    (ax,) = notebook.plot(history, None, ["train/loss"])
    assert ax.get_ylabel() == "train/loss" and list(ax.get_lines()[0].get_ydata()) == [1.0, 0.5, 1.0 / 3]
    matplotlib.pyplot.close("all")
    with pytest.raises(ValueError, match="no record has a number under 'nope'"):
        notebook.plot(history, None, ["nope"])


def test_progress_bar_falls_back_to_the_text_bar_without_a_warning(monkeypatch):
    """In a notebook without ipywidgets ``tqdm.auto`` warns "IProgress not found"
    and uses the text bar; the run's bar is that text bar, with no warning."""
    needs("IPython", "dev")
    import warnings

    from tqdm.std import tqdm as text_bar

    class _Kernel:
        config = {"IPKernelApp": {}}

    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: _Kernel(), raising=False)
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))  # "in Jupyter"
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    for name in [m for m in sys.modules if m in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook")]:
        monkeypatch.delitem(sys.modules, name)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        bar = notebook.progress_bar(total=3, initial=0)
    assert not [str(w.message) for w in warned]
    try:
        assert isinstance(bar, text_bar) and type(bar).__module__ in ("tqdm.std", "tqdm.asyncio")  # not the widget
    finally:
        bar.close()


def _interrupt_when_running(client, delay_s: float):
    """nbclient hook: interrupt the kernel ``delay_s`` after a cell tagged
    ``interrupt`` starts (the user's stop button)."""
    async def on_cell_execute(cell, cell_index):
        if "interrupt" in cell.metadata.get("tags", []):
            async def press_stop() -> None:
                await asyncio.sleep(delay_s)
                await client.km.interrupt_kernel()

            asyncio.ensure_future(press_stop())
    return on_cell_execute


@pytest.mark.timeout(300)
def test_quickstart_notebook_runs_in_a_jupyter_kernel_with_interrupts_mid_training(tmp_path):
    nbformat, nbclient, _ = needs("nbformat", "dev"), needs("nbclient", "dev"), needs("ipykernel", "dev")
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    launch_cell = next(c for c in nb.cells if c.cell_type == "code" and "launch(" in c.source)
    assert launch_cell.source.count("'policy.eval_every=10')") == 1
    launch_cell.source = launch_cell.source.replace(  # its run directory under tmp_path, not the checkout's runs/
        "'policy.eval_every=10')", f"'policy.eval_every=10', 'run.output_dir={tmp_path}')")
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.on_cell_execute = _interrupt_when_running(client, delay_s=4.0)
    t0 = time.perf_counter()
    client.execute()
    wall_s = time.perf_counter() - t0

    code = [c for c in nb.cells if c.cell_type == "code"]
    streams = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    for warning in ("IProgress", "Warning", "Traceback", "ipywidgets"):
        assert warning not in streams
    interrupted = [c for c in code if "interrupt" in c.metadata.get("tags", [])]
    assert len(interrupted) == 2
    for cell in code:
        errors = [(o.ename, o.evalue) for o in cell.outputs if o.output_type == "error"]
        if cell in interrupted:  # stopped by the interrupt, long before the budget's end, at a step boundary
            assert len(errors) == 1 and errors[0][0] in ("KeyboardInterrupt", "CancelledError"), errors
            assert errors[0][1].startswith("training stopped after step "), errors
        else:
            assert not errors, (cell.source, errors)
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    total_steps = yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["total_steps"]
    assert 5 + 3 < summary["steps"] <= total_steps and "run.total_steps:" not in streams  # within its budget
    (train_5,) = [c for c in code if c.source.startswith("run.train(5)")]
    (shown,) = [o.data["text/plain"] for o in train_5.outputs if o.output_type == "execute_result"]
    assert shown.startswith(f"TrainResult(5 steps (1-5 of {total_steps}), "), shown  # one line, not 5 records
    executed = tmp_path / "quickstart.executed.ipynb"
    nbformat.write(nb, executed)
    size_bytes = executed.stat().st_size
    assert size_bytes < 200_000, f"the executed notebook is {size_bytes} bytes"
    print(f"quickstart notebook: {wall_s:.1f} s, {summary['steps']} steps, {size_bytes} bytes executed")
