"""Training draft heads on a frozen target: data, self-distillation, features, the DeepSpeed loop, evaluation.

Entry points: ``specgraft train CONFIG.yaml`` (one process) and
``deepspeed --num_gpus N --module specgraft.train CONFIG.yaml`` (many).
"""
