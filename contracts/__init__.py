"""The shared contracts: the types every package may import, defined once.

    contracts.sample    Sample (rollout -> TransferQueue -> trainer), pack_tokens
    contracts.rollout   GroupRequest / GroupReport (policy <-> rollout actor),
                        SamplingParams, GenerateRequest, GenerateOutput (engine protocol)
    contracts.weights   Manifest, TensorEntry, ShardSpec, WeightUpdate (weight sync)

This package imports nothing of the project: ``transfer_queue``, ``sync``,
``loop``, ``actors`` and ``policies`` all sit above it.
"""
