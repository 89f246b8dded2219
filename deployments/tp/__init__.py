"""Tensor-parallel targets: DeepSpeed AutoTP ranks as Ray actors in the replica's placement group.

``placement`` reserves and starts the workers, ``shards`` loads one rank's slice of a checkpoint,
``worker`` is a rank (its shard, its share of the KV, the step), ``target`` the replica's side
(block tables, one call per step). A Qwen2.5-72B-Instruct replica on one 8-GPU node::

    model: /models/Qwen2.5-72B-Instruct
    dtype: bfloat16
    device: cuda
    tensor_parallel_size: 8        # Qwen2.5-72B has 8 KV heads: TP <= 8
    tp_worker_num_gpus: 1          # one GPU per rank; the replica itself needs none
    replica_num_cpus: 1
    gpu_memory: 80GiB              # checked by `toolspec plan` when the app is built
"""
