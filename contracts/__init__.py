"""The shared contracts: the types every package may import, defined once.

    contracts.sample    Sample (rollout -> TransferQueue -> trainer), pack_tokens
    contracts.rollout   GroupRequest / GroupReport (policy <-> rollout actor),
                        SamplingParams, GenerateRequest, GenerateOutput (engine protocol)
    contracts.training  BatchRequest / StepReport (policy <-> trainer actor)
    contracts.weights   Manifest, TensorEntry, ShardSpec, WeightUpdate (weight sync)
    contracts.placement Placement, node_address (where an actor runs: picks the transport)
    contracts.handles   RolloutHandle / TrainerHandle: the actors' endpoints, as handles call them

This package imports nothing of the project: ``transfer_queue``, ``sync``,
``loop``, ``actors`` and ``policies`` all sit above it.
"""
