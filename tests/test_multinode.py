"""A run on a local multi-node Ray cluster (several raylets on this machine, each
with its own resources and labels, as Ray's own tests do): each role lands where
``runtime.placement`` says, weights reach engines on other nodes bit for bit, a
placement the cluster cannot hold is one line at load, and a node lost mid-run
has its rollout actor and its storage unit replaced on the nodes left with the
accounting intact.

    node a (head)           trainer (the queue's controller: on the driver's node)
    node b                  rollout actor (rollout_slot, lossy_slot: 2)
    node c                  rollout actor, storage units (labels zone=c; store_slot: 2)
    node d (one test)       a rollout actor and a storage unit, then removed
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

import loop
from actors.launch import launch
from actors.placement import PlacementError, check_fits, role_plans
from actors.placement_config import PlacementConfig, RoleConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)

RUN = ("runtime.type=ray", "transfer_queue.deployment=ray", "transfer_queue.num_storage_units=2",
       "sync.transport=broadcast", "sync.backend=gloo", "rollout.num_actors=2", "rollout.engine.dtype=bfloat16",
       "trainer.lr=1e-5", "trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8",
       "run.progress=false", "runtime.placement.ready_timeout_s=20")


@pytest.fixture(scope="module")
def cluster():
    """Three raylets on this machine, on loopback; the test process is the driver."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected in this process")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}})
    nodes = {"a": c.head_node,
             "b": c.add_node(num_cpus=2, resources={"rollout_slot": 2, "lossy_slot": 2}, labels={"zone": "b"}),
             "c": c.add_node(num_cpus=2, resources={"rollout_slot": 2, "store_slot": 2}, labels={"zone": "c"})}
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    c.wait_for_nodes()
    # every node on loopback (tests/conftest.py): GCS, raylets, workers and this driver
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}, ray.nodes()
    yield c, {k: n.node_id for k, n in nodes.items()}
    ray.shutdown()
    c.shutdown()


def _node_of(actor: Any) -> str:
    """The node a Ray actor runs on, as Ray reports it inside the actor."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=30)


def _driver_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()  # any raylet of this host: not always the head's


def _check_engines_bit_exact(run: Any, step: int) -> None:
    want = loop.run(run.policy.trainer.weights_digest("bfloat16"))
    for rollout in run.policy.rollouts:
        assert loop.run(rollout.get_version()) == step
        assert loop.run(rollout.weights_digest()) == want


def _alive_storage_nodes() -> list[str]:
    """The node of every live storage-unit actor, from Ray's actor table (the GCS's; the
    dashboard's ``ray.util.state`` is not installed here)."""
    import ray

    return sorted(a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                  if a["ActorClassName"] == "StorageActor" and a["State"] == "ALIVE")


def _until(condition: Any, timeout_s: float, between: Any = lambda: time.sleep(0.2)) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {condition}"
        between()


def _identity_holds(record: dict[str, Any]) -> bool:
    return record["produced"] == record["trained"] + sum(record["dropped"].values()) + record["pending"]


@pytest.mark.ray
def test_each_role_lands_where_the_config_says_and_weights_cross_nodes_bit_exact(cluster, tmp_path):
    _, node = cluster
    run = launch(ROOT / "fully_async.yaml", *RUN, f"run.output_dir={tmp_path}",
                 "runtime.placement.trainer.resources={node_a: 0.1}",
                 "runtime.placement.rollout.resources={rollout_slot: 1}",
                 "runtime.placement.rollout.strategy=STRICT_SPREAD",
                 "runtime.placement.storage.labels={zone: c}")
    with run:
        policy = run.policy
        trainer_node = loop.run(policy.trainer.placement()).node
        rollout_nodes = {loop.run(h.placement()).node for h in policy.rollouts}
        assert trainer_node == node["a"]
        assert rollout_nodes == {node["b"], node["c"]}  # one per node: STRICT_SPREAD over the slots
        assert [_node_of(u) for u in run.queue._d.units] == [node["c"]] * 2  # the zone=c label
        assert _node_of(run.queue._d._controller) == _driver_node()
        assert run.weight_transport == "broadcast"
        for step in range(1, 4):
            (record,) = run.train(steps=1)
            assert record["sync/version"] == step and _identity_holds(record)
            _check_engines_bit_exact(run, step)


@pytest.mark.ray
@pytest.mark.parametrize("overrides, message", [
    (["runtime.placement.rollout.resources={gpu_slot: 1}"],
     r"^runtime\.placement\.rollout: the cluster \(3 nodes\) cannot hold 2 × \{CPU: 1, gpu_slot: 1\} \(PACK\): "
     r"2 × 1 gpu_slot are needed, 0 left on its nodes"),
    (["runtime.placement.storage.labels={zone: z}"],
     r"^runtime\.placement\.storage: .*: no node has the labels \{'zone': 'z'\}$"),
    (["rollout.num_actors=4", "runtime.placement.rollout.strategy=STRICT_SPREAD"],
     r"^runtime\.placement\.rollout: .*STRICT_SPREAD needs 4 nodes with \{CPU: 1\} each, 3 have it$"),
])
def test_a_placement_the_cluster_cannot_hold_is_one_line_at_load(cluster, tmp_path, overrides, message):
    with pytest.raises(PlacementError, match=message) as err:
        launch(ROOT / "fully_async.yaml", *RUN, f"run.output_dir={tmp_path}", *overrides)
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing left behind


@pytest.mark.ray  # ~45-65 s: the replacements start processes (one loads the model) while the run goes on
def test_a_node_lost_mid_run_has_its_rollout_actor_and_storage_unit_replaced_and_nothing_is_lost(cluster, tmp_path):
    import ray

    c, node = cluster
    lost = c.add_node(num_cpus=2, resources={"lossy_slot": 1, "store_slot": 1})
    c.wait_for_nodes()
    run = launch(ROOT / "fully_async.yaml", *RUN, f"run.output_dir={tmp_path}",
                 "runtime.placement.trainer.resources={node_a: 0.1}",
                 "runtime.placement.rollout.resources={lossy_slot: 1}", "runtime.placement.rollout.strategy=SPREAD",
                 "runtime.placement.storage.resources={store_slot: 1}", "runtime.placement.storage.strategy=SPREAD")
    with run:
        policy, queue = run.policy, run.queue._d
        where = {h.name: loop.run(h.placement()).node for h in policy.rollouts}
        assert sorted(where.values()) == sorted([node["b"], lost.node_id])
        unit_nodes = [_node_of(u) for u in queue.units]
        assert sorted(unit_nodes) == sorted(_alive_storage_nodes()) == sorted([node["c"], lost.node_id])
        doomed = unit_nodes.index(lost.node_id)
        records = run.train(steps=2)
        # the unit holds samples when its node goes (rollout goes on between steps): they are lost, counted
        _until(lambda: ray.get(queue.units[doomed].num_rows.remote()) > 0, 60,
               between=lambda: records.extend(run.train(steps=1)))
        c.remove_node(lost)  # its raylet and every worker on it die; rollout goes on meanwhile

        def unit_replaced() -> bool:
            return ray.get(queue._controller.unit_states.remote())[doomed].generation == 1

        deadline = time.monotonic() + 120  # the replacements start processes (one loads the model) meanwhile
        while (not policy.num_respawns or policy.replacing or not unit_replaced()) and time.monotonic() < deadline:
            records += run.train(steps=1)
        state = ray.get(queue._controller.unit_states.remote())[doomed]
        assert state.live and state.gone is None and state.first_slot > 0
        assert _alive_storage_nodes() == [node["c"], node["c"]]  # its bundle placed again: the store_slot left
        stored = lambda: ray.get(state.actor.__ray_call__.remote(lambda self: self.num_stored))  # noqa: E731
        _until(lambda: stored() > 0, 120, between=lambda: records.extend(run.train(steps=1)))  # new samples reach it
        records += run.train(steps=1)  # a step with both replacements in use
        assert all(_identity_holds(r) for r in records)
        assert policy.num_lost_rollouts == 1 and policy.num_respawns == 1, policy.lost_rollouts
        assert len(policy.rollouts) == 2, policy.lost_rollouts
        assert {loop.run(h.placement()).node for h in policy.rollouts} == {node["b"]}  # the slots left
        _check_engines_bit_exact(run, policy.step)
        # what the lost node held is counted: groups its actor took unreported, samples its storage unit held
        assert set(records[-1]["dropped"]) <= {"actor_died", "storage_lost"}
        assert records[-1]["dropped"]["storage_lost"] > 0, records[-1]["dropped"]
        run.check()  # rollout stopped: every actor's own counts add up, and to the queue's


def test_a_colocated_layout_puts_a_trainer_worker_and_an_engine_in_each_gpu_bundle():
    """2 nodes × 8 GPUs, 16 trainer workers and 16 engines at half a GPU each: 16 bundles
    of one GPU; the nodes' CPUs are checked too, before any group is made."""
    half = RoleConfig(num_gpus=0.5)
    p = PlacementConfig(colocate=True, trainer=half, rollout=half)
    plans = role_plans(p, {"trainer": 16, "rollout": 16, "storage": 2},
                       {"trainer": (1, 0.5), "rollout": (1, 0.5), "storage": (0, 0)})
    assert [(x.role, len(x.bundles), x.bundles[0]) for x in plans] == [
        ("trainer", 16, {"CPU": 2, "GPU": 1.0}), ("storage", 2, {"memory": float(1 << 20)})]
    assert plans[0].shares == {"trainer": {"CPU": 1, "GPU": 0.5}, "rollout": {"CPU": 1, "GPU": 0.5}}
    node = {"Alive": True, "Resources": {"CPU": 16, "GPU": 8, "memory": 1e9}, "Labels": {}}
    check_fits(plans, [node, dict(node)])
    small = {**node, "Resources": {**node["Resources"], "CPU": 8}}
    with pytest.raises(PlacementError, match=r"^runtime\.placement\.trainer: .*\(PACK with the rollout actors, "
                                             r"colocate\): 16 × 2 CPU are needed, 16 left on its nodes \(8, 8 per node\)$"):
        check_fits(plans, [small, dict(small)])
